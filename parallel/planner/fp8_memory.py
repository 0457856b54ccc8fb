"""What FP8 training through Transformer Engine changes in trainer memory (model.fp8 != "none").

parallel/fp8.py builds Megatron with fp8_param = False: the primary weights stay bf16 (and the fp32
master copy stays in the optimizer), and TE keeps, for every FP8 linear layer, a cached FP8 copy of
the weight across the micro-batches of a step (Megatron passes is_first_microbatch): a row-wise copy
for the forward GEMM and a column-wise (transposed) one for the data-gradient GEMM, since Hopper's FP8
GEMMs take only the TN layout (Blackwell's mxfp8 keeps both as well, each with its E8M0 block scales).
So FP8 *adds* weight memory; what it saves is activations: every linear layer saves its input for the
weight gradient already quantized (1 byte, plus scales) instead of bf16.

FP8 linear layers in Megatron-Core's TE spec: attention and MLA projections, dense MLPs, shared and
routed experts. Not FP8: embedding, output head, router, norms, the DSA indexer (kept in bf16).
"""
from __future__ import annotations

from sao_megatron.core.dims import ParallelDims

from ..model_shapes import embedding_params, head_params, is_mla, is_moe_layer
from .activations import attention_dims, in_flight_micro_batches
from .layouts import stage_ranges
from .params import rank_params

# Bytes per linear parameter of TE's cached FP8 weight copies (row-wise + column-wise, with scales).
FP8_WEIGHT_COPY_BYTES = {
    "delayed": 2.0,                                  # per-tensor scale: two 1-byte copies
    "tensorwise": 2.0,
    "blockwise": 2 * (1 + 4 / (128 * 128)),          # fp32 scale per 128x128 weight block
    "mxfp8": 2 * (1 + 1 / 32),                       # E8M0 scale per 32 elements
}


def fp8_linear_params(cfg: dict, layout: ParallelDims, stage: int, value_head: bool = False) -> float:
    """Parameters of the FP8 linear layers on one rank of `stage` (TP-split part without the
    embedding and head, plus the routed experts on the rank)."""
    p = rank_params(cfg, layout, stage, value_head=value_head)
    outside = embedding_params(cfg) if stage == 0 else 0
    if stage == layout.pp - 1 and not value_head:
        outside += head_params(cfg)
    return p.tp_split - outside / layout.tp + p.expert


def fp8_weight_copy_bytes(cfg: dict, layout: ParallelDims, stage: int, recipe: str, value_head: bool = False) -> float:
    if recipe in ("none", "", None):
        return 0.0
    return fp8_linear_params(cfg, layout, stage, value_head) * FP8_WEIGHT_COPY_BYTES[recipe]


def fp8_saved_elems(cfg: dict, moe: bool, layout: ParallelDims) -> tuple[float, float]:
    """(replaced, added) elements per token of one layer (TE kernels, no full recompute):
    `replaced` are saved linear inputs TE now saves in FP8 instead of bf16 (the fused norms' outputs
    feeding qkv and fc1, MLA's normalised latents, fc2's input, the experts' fc1 and fc2 inputs);
    `added` is the FP8 copy of the attention output that linear_proj saves while flash attention
    keeps its own bf16 output for its backward."""
    h, tp = cfg["hidden_size"], layout.tp
    _, _, out, latent = attention_dims(cfg)
    replaced = 2 * h / tp + (latent if is_mla(cfg) else 0)
    if moe:
        fm, k = cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
        replaced += (cfg.get("n_shared_experts") or 0) * fm / tp + k / tp * (layout.etp * h + fm)
    else:
        replaced += cfg["intermediate_size"] / tp
    return replaced / layout.cp, out / tp / layout.cp


def fp8_activation_saving(cfg: dict, layout: ParallelDims, stage: int, tokens: int, recompute: str,
                          act_bytes: int) -> float:
    """Bytes FP8 removes from activation_bytes(...) of the same rank (TE kernels). Under full recompute
    only the one layer rebuilt during backward changes (the stored layer inputs stay bf16)."""
    layers = stage_ranges(cfg["num_hidden_layers"], layout.pp, layout.vpp, layout.last_stage_layers)[stage]
    if not layers:
        return 0.0

    def saving(i: int) -> float:
        replaced, added = fp8_saved_elems(cfg, is_moe_layer(cfg, i), layout)
        return (replaced * (act_bytes - 1) - added) * tokens

    if recompute == "full":
        return max(saving(i) for i in layers)
    return sum(saving(i) for i in layers) * in_flight_micro_batches(layout, stage)
