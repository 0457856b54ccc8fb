"""Parameters one rank holds for a layout: TP-split, replicated and expert parts, and what is frozen."""
from __future__ import annotations

from dataclasses import dataclass

from sao_megatron.core.dims import ParallelDims

from ..model_shapes import LayerParams, all_layers, embedding_params, head_params
from .layouts import stage_ranges


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds, by kind. Dense and expert parts are per rank (already divided)."""

    tp_split: float      # attention, dense MLP, shared experts, embedding/head: 1/tp on each rank
    replicated: float    # norms, routers, DSA indexer: whole on every rank of the stage
    expert: float        # routed experts: 1/(ep·etp) on each rank
    frozen_split: float = 0.0       # part of tp_split that is not trained (critic with frozen attention)
    frozen_replicated: float = 0.0  # part of replicated that is not trained (the DSA indexer)

    @property
    def total(self) -> float:
        return self.tp_split + self.replicated + self.expert

    @property
    def frozen_dense(self) -> float:
        return self.frozen_split + self.frozen_replicated


def _layer_split(p: LayerParams, trainable: str) -> tuple[int, int, int, int, int]:
    """(tp-split, replicated, expert, frozen tp-split, frozen replicated) parameters of one layer."""
    split = p.attention + p.dense_mlp + p.shared_experts + p.mtp_extra
    repl = p.attention_norms + p.indexer + p.router + p.norms
    if trainable != "moe_only":
        return split, repl, p.routed_experts, 0, 0
    # Critic with frozen attention (SAO): attention, indexer and dense MLPs get no grads.
    return split, repl, p.routed_experts, p.attention + p.dense_mlp + p.mtp_extra, p.indexer


def rank_params(cfg: dict, layout: ParallelDims, stage: int, trainable: str = "all", value_head: bool = False) -> RankParams:
    """Parameters on one rank of pipeline stage `stage`. trainable: 'all' | 'moe_only' (critic)."""
    layers = all_layers(cfg)
    sums = [0, 0, 0, 0, 0]  # split, replicated, expert, frozen split, frozen replicated
    for index in stage_ranges(cfg["num_hidden_layers"], layout.pp, layout.vpp, layout.last_stage_layers)[stage]:
        sums = [a + b for a, b in zip(sums, _layer_split(layers[index], trainable))]
    split, repl, expert, frozen_split, frozen_repl = sums
    if stage == 0:
        split += embedding_params(cfg)
        frozen_split += embedding_params(cfg) if trainable == "moe_only" else 0
    if stage == layout.pp - 1:
        repl += cfg["hidden_size"]  # final norm
        if value_head:
            repl += cfg["hidden_size"] + 1
        else:
            split += head_params(cfg)
    return RankParams(split / layout.tp, float(repl), expert / (layout.ep * layout.etp), frozen_split / layout.tp,
                      float(frozen_repl))


def model_total_from_ranks(cfg: dict, layout: ParallelDims) -> float:
    """Σ over stages of one copy of each shard: must equal count_parameters(cfg).total."""
    total = 0.0
    for stage in range(layout.pp):
        p = rank_params(cfg, layout, stage)
        total += p.tp_split * layout.tp + p.replicated + p.expert * layout.ep * layout.etp
    return total
