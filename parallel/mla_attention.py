"""Core attention for multi-latent attention (GLM-5, DeepSeek-V3), dense or DeepSeek-sparse (DSA).

Megatron-Core 0.16.1's MLASelfAttention computes q, k ([.., nope + rope] per head) and v ([.., v_head_dim]
per head) and hands them to a core attention module. The local DotProductAttention cannot take a
query-key head wider than the value head, and Megatron's DSAttention needs bf16 Hadamard kernels and
applies a RoPE layout other than GLM-5's. So both are ours, one module:

- `MLACoreAttention`: causal softmax(q k^T * scale) v with separate q/k and v widths, fp32 scores. With
  ``indexer_kind`` = "full" it owns a lightning indexer; with "shared" it reuses the selection of the
  previous full layer in its model chunk (transformers' and SGLang's "shared" indexer layers).
- `LightningIndexer`: transformers' GlmMoeDsaIndexer computation (modeling_glm_moe_dsa.py:185-242):
  q = wq_b(q latent), k = LayerNorm(wk(x)), interleaved RoPE on the first qk_rope_head_dim channels of
  both, scores_t = sum_h weights_proj(x)_h * H^-1/2 * relu(q_h . k_t * D^-1/2), masked causally; then
  checkpoints/arch/dsa.py `select_topk`, the tie rule the reference server uses too.

Selection per forward (`IndexerSelection`, driven by parallel/indexer_replay.py): replay the engine's
`indexer_topk` when the batch carries it (counting how many replayed choices the trainer's own indexer
also makes: train/indexer_agreement), else select with the own indexer. The indexer's inputs are
detached, as in Megatron's DSAttention: the policy loss never trains it; it trains only through
Megatron's indexer KL loss when `model.indexer_loss_coeff` > 0.

Packed micro-batches (parallel.pack_sequences) reach it on the local spec as a block-diagonal attention mask,
which both the attention and the indexer's selection honour (no key of another sample is attended or selected).
Not supported (one-line errors): THD input (Transformer Engine's packed form) and context parallelism with DSA.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from checkpoints.arch.dsa import select_topk, selected_key_mask


class IndexerSelection:
    """What one sparse layer attends to in the next forward: the engine's choices or its own.

    Activation recompute re-runs forwards during backward, in the order of the forwards, so like
    Megatron's RouterReplay each replayed forward also queues its targets for its recompute.
    """

    def __init__(self):
        self.targets: Optional[torch.Tensor] = None    # [b, sq, topk] positions for the next forward
        self.backward: list[torch.Tensor] = []          # targets queued for recomputes, oldest first
        self.in_backward = False
        self.agreement = None                            # parallel.indexer_replay.IndexerAgreement

    def set_targets(self, targets: Optional[torch.Tensor]) -> None:
        """Before each forward: a new forward is never a recompute (the backward hook of a chunk's output
        switches to the queue again when that micro-batch's backward starts)."""
        self.targets, self.in_backward = targets, False
        if targets is not None:
            self.backward.append(targets)

    def next_targets(self) -> tuple[Optional[torch.Tensor], bool]:
        """(targets for this forward or None, whether this forward is a recompute)."""
        if self.in_backward and self.backward:
            return self.backward.pop(0), True
        return self.targets, False

    def clear(self) -> None:
        self.targets, self.backward, self.in_backward = None, [], False


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb_interleave on x [s, b, ..., d]: channels (0,1), (2,3), ... are
    pairs; the result is laid out de-interleaved (evens, then odds), as transformers leaves it."""
    d = x.shape[-1]
    x = x.unflatten(-1, (d // 2, 2)).transpose(-1, -2).flatten(-2)
    half = x[..., : d // 2], x[..., d // 2:]
    rotated = torch.cat([-half[1], half[0]], dim=-1)
    return x * cos + rotated * sin


class LightningIndexer(torch.nn.Module):
    """The DSA indexer's weights (HF names, replicated over TP) and its scores."""

    def __init__(self, config):
        super().__init__()
        self.n_heads, self.head_dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.rope_dim = config.qk_pos_emb_head_dim
        q_rank = config.q_lora_rank or config.hidden_size
        dtype = config.params_dtype
        self.wq_b = torch.nn.Linear(q_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.wk = torch.nn.Linear(config.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.k_norm = torch.nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = torch.nn.Linear(config.hidden_size, self.n_heads, bias=False, dtype=dtype)
        for linear in (self.wq_b, self.wk, self.weights_proj):
            config.init_method(linear.weight)
        self.rotary = _indexer_rotary(config)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim:]
        return torch.cat([_rope_interleaved(rot, cos, sin), rest], dim=-1)

    def forward(self, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        """x [s, b, hidden], qr [s, b, q_lora_rank] (full sequence) -> fp32 scores [b, s, s], -inf above
        the diagonal (a query selects among keys at or before its own position)."""
        s, b = x.shape[:2]
        cos, sin = self._cos_sin(s, x.device)
        q = self._rope(self.wq_b(qr).view(s, b, self.n_heads, self.head_dim).float(), cos.unsqueeze(2), sin.unsqueeze(2))
        k = self._rope(self.k_norm(self.wk(x)).float(), cos, sin)
        dots = torch.relu(torch.einsum("sbhd,tbd->bsht", q, k) * self.head_dim ** -0.5)
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5          # [s, b, H]
        scores = torch.einsum("bsht,sbh->bst", dots, weights)
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        return scores.masked_fill(future, float("-inf"))

    def _cos_sin(self, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.rotary(s)
        angles, mscale = out if isinstance(out, tuple) else (out, 1.0)
        angles = angles[:s].reshape(s, 1, -1).to(device).float()             # [s, 1, rope_dim]
        return angles.cos() * mscale, angles.sin() * mscale


def _indexer_rotary(config):
    """The same rotary frequencies (and YaRN mscale) as the layer's MLA, at the rope head width."""
    from megatron.core.models.common.embeddings import RotaryEmbedding, YarnRotaryEmbedding

    if config.rope_type == "rope":
        return RotaryEmbedding(config.qk_pos_emb_head_dim, rotary_percent=1.0, rotary_base=config.rotary_base)
    return YarnRotaryEmbedding(config.qk_pos_emb_head_dim, rotary_base=config.rotary_base,
                               scaling_factor=config.rotary_scaling_factor,
                               original_max_position_embeddings=config.original_max_position_embeddings,
                               beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                               mscale_all_dim=config.mscale_all_dim)


def attend(query, key, value, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """query/key [s, b, n, dk], value [s, b, n, dv], keep bool [b or 1, sq, sk] -> [sq, b, n * dv]."""
    sq, b, n, _ = query.shape
    scores = torch.einsum("sbnd,tbnd->bnst", query.float(), key.float()) * scale
    scores = scores.masked_fill(~keep.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.einsum("bnst,tbnd->sbnd", probs, value)
    return out.reshape(sq, b, n * value.shape[-1])


class MLACoreAttention(torch.nn.Module):
    """Megatron core-attention signature (see DotProductAttention) for MLA, dense or sparse.

    indexer_kind: "none" (dense), "full" (own indexer) or "shared" (the previous full layer's
    selection), per layer from the HF config (parallel/specs.py puts it in the layer's spec)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None, cp_comm_type=None,
                 pg_collection=None, indexer_kind: str = "none"):
        super().__init__()
        self.config, self.layer_number, self.indexer_kind = config, layer_number, indexer_kind
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(k_channels or config.kv_channels)
        self.topk = int(getattr(config, "dsa_indexer_topk", 0) or 0)
        self.indexer = LightningIndexer(config) if self.indexer_kind == "full" else None
        self.selection = IndexerSelection()
        self.source: Optional["MLACoreAttention"] = None   # a shared layer's full layer, same chunk
        self.last_selected: Optional[torch.Tensor] = None  # this forward's choice, for shared layers

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, x=None, qr=None, **_):
        if packed_seq_params is not None:
            raise ValueError("multi-latent attention on our core attention takes no THD (packed) input; fix: set "
                             "parallel.pack_sequences = false, or model.transformer_impl = local")
        sq, sk = query.shape[0], key.shape[0]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril().unsqueeze(0)
        if attention_mask is not None:   # Megatron's convention: True = masked out
            keep = keep & ~attention_mask.reshape(-1, sq, sk).bool()
        scores = None
        if self.indexer_kind != "none":
            selected, scores = self._select(x, qr, attention_mask)
            self.last_selected = selected
            chosen = selected_key_mask(selected, sk)
            # a query without any selection (the last token and padding carry -1 only) keeps causal
            # attention: an all-masked row is NaN, and 0 * NaN in the next layer's probs @ values
            # would spread it to every position
            keep = keep & (chosen | ~chosen.any(dim=-1, keepdim=True))
        out = attend(query, key, value, keep, self.softmax_scale)
        if scores is not None and self.training and torch.is_grad_enabled() and self._loss_coeff() > 0:
            out = self._with_indexer_loss(out, scores, selected, query, key)
        return out

    def _select(self, x, qr, attention_mask=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(selected key positions [b, sq, topk], the own indexer's scores or None)."""
        targets, recompute = self.selection.next_targets()
        if self.indexer is None:   # "shared": the engine's choice for this layer, else the full layer's
            if targets is not None:
                return targets, None
            if self.source is None or self.source.last_selected is None:
                raise ValueError(f"layer {self.layer_number - 1} reuses an earlier layer's indexer selection, which "
                                 "is on another pipeline stage; fix: replay the engine's indexer_topk (serve with "
                                 "--enable-return-indexer-topk) or split stages after a full indexer layer")
            return self.source.last_selected, None
        scores = self.indexer(*_full_sequence(self.config, x.detach(), qr.detach()))
        if attention_mask is not None:   # packed rows: never select a key of another sample
            scores = scores.masked_fill(attention_mask.reshape(-1, *scores.shape[-2:]).bool(), float("-inf"))
        own = select_topk(scores, self.topk)
        if targets is not None and not recompute and self.selection.agreement is not None:
            self.selection.agreement.count(targets, own)
        return (targets if targets is not None else own), scores

    def _loss_coeff(self) -> float:
        return float(getattr(self.config, "dsa_indexer_loss_coeff", 0.0) or 0.0)

    def _with_indexer_loss(self, out, scores, selected, query, key):
        """Megatron's indexer KL loss (dsa.py compute_dsa_indexer_loss: the indexer's distribution
        against the layer's attention, summed over heads and TP ranks) rides on the output through
        Megatron's auto-scaler, so its gradient reaches only the indexer's weights."""
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.experimental_attention_variant.dsa import (DSAIndexerLossAutoScaler,
                                                                                  compute_dsa_indexer_loss)

        groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        loss = compute_dsa_indexer_loss(scores, selected.clamp(min=0), query.detach(), key.detach(),
                                        self.softmax_scale, self._loss_coeff(), False, groups)
        return DSAIndexerLossAutoScaler.apply(out, loss)


def _full_sequence(config, x: torch.Tensor, qr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Under sequence parallelism MLA hands the core attention this TP rank's slice of x and of the q
    latent; the indexer scores the whole sequence (its weights are replicated over TP)."""
    if config.sequence_parallel and config.tensor_model_parallel_size > 1:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        qr = gather_from_sequence_parallel_region(qr, tensor_parallel_output_grad=False)
    return x, qr


def sparse_layers(model_chunk: torch.nn.Module) -> list[tuple[int, MLACoreAttention]]:
    """(global 0-based layer, core attention) of every DSA layer in this chunk, in layer order."""
    found = [(m.layer_number - 1, m) for m in model_chunk.modules()
             if isinstance(m, MLACoreAttention) and m.indexer_kind != "none"]
    return sorted(found, key=lambda pair: pair[0])


def link_shared_layers(model_chunk: torch.nn.Module) -> None:
    """Point each "shared" layer at the nearest earlier "full" layer of the same chunk (None when that
    layer lives on another pipeline stage: the shared layer then needs replayed selections)."""
    last_full = None
    for _, module in sparse_layers(model_chunk):
        if module.indexer_kind == "full":
            last_full = module
        else:
            module.source = last_full
