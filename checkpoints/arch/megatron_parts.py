"""Megatron TransformerConfig and RoPE pieces that several families share (values in HF key names).

A family module's `megatron(hf)` returns only what differs from parallel/specs.py's common kwargs
(sizes, norms, dtype, parallel sizes, disabled CPU-less fusions); these are the repeated parts.
"""
from __future__ import annotations

from typing import Any, Mapping


def rope_theta(hf: Mapping[str, Any]) -> float:
    """transformers 5 moved rope_theta into rope_parameters; accept both spellings."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)


def partial_rope(hf: Mapping[str, Any]) -> dict:
    """GPTModel RoPE kwargs for grouped-query attention; partial_rotary_factor may sit in rope_parameters."""
    percent = float(hf.get("partial_rotary_factor", 1.0))
    params = hf.get("rope_parameters") or {}
    percent = float(params.get("partial_rotary_factor", percent))
    return dict(position_embedding_type="rope", rotary_base=int(rope_theta(hf)), rotary_percent=percent)


def gqa_kwargs(hf: Mapping[str, Any]) -> dict:
    """Grouped-query attention: KV groups and the per-head width."""
    return dict(num_query_groups=int(hf["num_key_value_heads"]),
                kv_channels=int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]))


def first_k_dense(hf: Mapping[str, Any]) -> int:
    """DeepSeek/GLM: the first `first_k_dense_replace` layers have a dense MLP."""
    return int(hf.get("first_k_dense_replace", 0))


def sigmoid_router_kwargs(hf: Mapping[str, Any]) -> dict:
    """DeepSeek/GLM router: sigmoid scores with a fixed correction bias, one shared expert, dense first layers."""
    dense, layers = first_k_dense(hf), int(hf["num_hidden_layers"])
    grouped = (hf.get("n_group") or 1) > 1
    return dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # RL keeps the pretrained correction bias fixed
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        moe_router_num_groups=hf.get("n_group") if grouped else None,
        moe_router_group_topk=hf.get("topk_group") if grouped else None,
        moe_router_pre_softmax=False, moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=int(hf.get("n_shared_experts", 1)) * int(hf["moe_intermediate_size"]),
        moe_layer_freq=[0] * dense + [1] * (layers - dense),
    )
