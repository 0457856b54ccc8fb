"""Activation bytes one rank stores for backward: per layer per token, times the micro-batches in flight."""
from __future__ import annotations

from sao_megatron.core.dims import ParallelDims

from ..model_shapes import has_qk_norm, is_mla, is_moe_layer
from .layouts import stage_ranges


def layer_activation_elems(cfg: dict, moe: bool, layout: ParallelDims, recompute: str, kernels: str = "te",
                           seq_len: int = 0) -> float:
    """Stored activation elements per token of the micro-batch for one layer on one rank.

    Tokens are split by cp; h-sized tensors by tp (sequence parallel), head-sized ones by tp (heads).
    kernels 'te' (Transformer Engine spec, the GPU path): flash attention stores no s² score matrix,
    fused SwiGLU; DSA layers are the exception (dsa_score_elems). kernels 'local' (Megatron-Core's local spec, what runs on CPU): see
    _local_layer_elems; `seq_len` is the padded row length its unfused attention scores span.
    'selective' recomputes the core attention (Megatron's default recompute_modules, which
    parallel/rl_model.py keeps): under flash attention that stores nothing less. 'full' keeps only the
    layer input (plus one layer's working set, added by the caller).
    """
    h, tp = cfg["hidden_size"], layout.tp
    if recompute == "full":
        return h / tp / layout.cp
    if kernels == "local":
        return _local_layer_elems(cfg, moe, layout, recompute, seq_len or 1)
    q, kv, out, latent = attention_dims(cfg)
    attn = 2 * h / tp + (q + 2 * kv + out) / tp + latent
    if cfg.get("index_n_heads"):
        attn += cfg["index_n_heads"] * cfg["index_head_dim"] + cfg["index_head_dim"]
    if cfg.get("index_topk") and recompute == "none":
        attn += dsa_score_elems(cfg, tp, seq_len or 1)
    if moe:
        fm, k = cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
        fs = (cfg.get("n_shared_experts") or 0) * fm
        mlp = 2 * h / tp + 3 * fs / tp
        # Each token goes to k experts; balanced routing gives each rank as many copies as it sends.
        mlp += k / tp * (layout.etp * h + 3 * fm)
    else:
        mlp = 2 * h / tp + 3 * cfg["intermediate_size"] / tp
    return (attn + mlp) / layout.cp


def dsa_score_elems(cfg: dict, tp: int, seq_len: int) -> float:
    """Per token, in bf16 elements: what a DSA layer's attention saves for backward under TE too. TE has no
    sparse attention, so those layers run parallel/mla_attention.py `attend` (parallel/specs.py): it masks a
    dense score row of seq_len keys per head and keeps the fp32 softmax output (2 bf16 elements per key)
    and its bf16 copy (1), heads/tp per token, plus the bool keep mask (one byte per key, all heads).
    'selective' recompute re-runs the core attention and keeps none of it; 'full' adds it once, for the
    layer rebuilt during backward."""
    return 3 * cfg["num_attention_heads"] / tp * seq_len + seq_len / 2


def _local_layer_elems(cfg: dict, moe: bool, layout: ParallelDims, recompute: str, seq_len: int) -> float:
    """Elements per token autograd saves in one layer of Megatron-Core's local spec (unfused kernels).

    Counted tensor by tensor from what each module saves for backward (bench/parallel.py measures
    the same bytes with saved-tensor hooks); terms under 1% of a layer are left out:
    - each RMSNorm: its input and normalised output (2 per width), per-row rstd; rotary: q and k;
    - unfused core attention: q, k and v repeated to every query head, and the softmax
      probabilities, heads/tp · seq_len per token (no flash attention); 'selective' recompute keeps
      only its inputs q, k, v instead;
    - every linear: its input;
    - SequentialMLP experts, per token copy: fc1 input h, fc1 output 2·fm, SiLU input and output
      2·fm, the router-probability product fm, fc2 input fm, the probability (6·fm + h + 1);
      dense MLPs and shared experts the same without the probability product (5·f).
    """
    h, tp = cfg["hidden_size"], layout.tp
    q, kv, out, latent = attention_dims(cfg)
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    attn = 2 * h / tp + h / tp + (q + kv) / tp + latent          # input norm, qkv input, rotary
    if has_qk_norm(cfg):
        attn += (2 * (q + kv) + nh + nkv) / tp
    if recompute == "selective":
        attn += (q + 2 * kv) / tp
    else:
        attn += (2 * q + out) / tp + nh * seq_len / tp
    attn += out / tp                                             # linear_proj input
    if cfg.get("index_n_heads"):
        attn += cfg["index_n_heads"] * cfg["index_head_dim"] + cfg["index_head_dim"]
    mlp = 2 * h / tp                                             # pre-MLP norm
    if moe:
        fm, k = cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
        fs = (cfg.get("n_shared_experts") or 0) * fm
        mlp += h / tp + 5 * fs / tp                              # router input, shared experts
        mlp += k / tp * (layout.etp * h + 6 * fm + layout.etp)
    else:
        mlp += h / tp + 5 * cfg["intermediate_size"] / tp
    return (attn + mlp) / layout.cp


def attention_dims(cfg: dict) -> tuple[int, int, int, int]:
    """(q width, k (= v-side) width, attention output width, replicated latent width) per token."""
    nh = cfg["num_attention_heads"]
    if is_mla(cfg):
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        v = cfg["v_head_dim"]
        # k and v are expanded per head for attention; MLA's latents are not split over TP.
        return nh * qk, nh * (qk + v) // 2, nh * v, cfg["q_lora_rank"] + cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    nkv = cfg.get("num_key_value_heads", nh)
    return nh * hd, nkv * hd, nh * hd, 0


def in_flight_micro_batches(layout: ParallelDims, stage: int) -> float:
    """1F1B keeps pp - stage micro-batches alive; interleaving adds (pp-1)/(pp·vpp) on stage 0
    (Narayanan et al. 2021; Korthikanti et al. 2022, eq. for the interleaved schedule)."""
    if layout.vpp > 1:
        return layout.pp * (1 + (layout.pp - 1) / (layout.pp * layout.vpp))
    return float(layout.pp - stage)


def activation_bytes(cfg: dict, layout: ParallelDims, stage: int, tokens: int, recompute: str, act_bytes: int,
                     value_head: bool = False, kernels: str = "te", seq_len: int = 0) -> float:
    """Activation memory of one rank of `stage` for micro-batches of `tokens` tokens (before CP).
    seq_len: the padded row length (local kernels only; 0 = one row of `tokens`)."""
    moe_flags = [is_moe_layer(cfg, i) for i in range(cfg["num_hidden_layers"])]
    layers = stage_ranges(cfg["num_hidden_layers"], layout.pp, layout.vpp, layout.last_stage_layers)[stage]

    def elems(i: int, mode: str) -> float:
        return layer_activation_elems(cfg, moe_flags[i], layout, mode, kernels, seq_len or tokens)

    per_mb = sum(elems(i, recompute) for i in layers) * tokens * act_bytes
    total = per_mb * in_flight_micro_batches(layout, stage)
    if recompute == "full" and layers:  # one layer is rebuilt at a time during backward
        total += max(elems(i, "none") for i in layers) * tokens * act_bytes
    if stage == layout.pp - 1 and not value_head:
        # fp32 logits for log-probs plus their bf16 copy, vocab split over TP.
        total += tokens / layout.cp * cfg["vocab_size"] / layout.tp * (4 + act_bytes)
    return total
