"""Megatron's local DotProductAttention, plus packed (THD) input: one causal attention per sample.

Megatron-Core 0.16.1's Attention already takes THD on the local spec: it squeezes q/k/v to [tokens, heads,
dim], applies RoPE per sample from cu_seqlens (transformer/attention.py:1066-1110, rope_utils
_apply_rotary_pos_emb_thd) and reshapes the core attention's output back (:1189). Only the local core
attention refuses it (dot_product_attention.py asserts packed_seq_params is None). This subclass runs the
parent's own computation on each cu_seqlens segment, so a packed sample sees exactly what it sees as a
padded row (positions 0.., causal within itself) and attention costs sum(len^2), not the whole packed row's
square. Without packed_seq_params it is the parent, unchanged.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd" or attention_mask is not None:
            raise ValueError("packed attention on the local spec takes THD input without a mask")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        parts = []
        for start, stop in zip(bounds[:-1], bounds[1:]):   # [tokens, heads, dim] -> one [s, b=1, heads, dim] each
            q, k, v = (t[start:stop].unsqueeze(1) for t in (query, key, value))
            parts.append(super().forward(q, k, v, None, attn_mask_type, attention_bias))
        return torch.cat(parts, dim=0)   # [tokens, 1, heads * dim]; Attention reshapes it to [t, 1, h]
