"""`ShardLayout`: which slice of the model one trainer rank holds (Megatron-Core conventions).

- TP splits column-parallel weights on dim 0 and row-parallel weights on dim 1, in `tp_size` equal
  contiguous chunks; expert weights are split the same way by the expert-TP size (`etp`, = tp unless
  set). Vocabulary rows are padded to `padded_vocab_size` first (Megatron pads the vocabulary so each
  TP rank holds an equal slice).
- EP: rank e holds global experts g = e*E/EP + j for local j in [0, E/EP).
- PP/VPP (megatron.core.transformer.transformer_layer.get_transformer_layer_offset): virtual chunk v
  of pipeline rank p holds the global layers `core.dims.layer_range` gives (an even split, or
  Megatron's uneven last stage with `last_stage_layers`), numbered locally from 0. The embedding
  lives on (p=0, v=0), the final norm and output layer on (p=pp-1, v=vpp-1).

A ShardLayout is one rank's coordinates and slicing rules, not a second layout record: its sizes
are checked by `dims()`, the ParallelDims of the smallest world holding these shards
(sao_megatron/core/dims.py has the one copy of the layout rules).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Iterator

from sao_megatron.core.dims import ParallelDims, layer_range


@dataclass(frozen=True)
class ShardLayout:
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    vpp_size: int = 1
    etp_size: int = 0              # expert tensor parallel size; 0 = tp_size (Megatron's default)
    etp_rank: int = -1             # -1 = tp_rank mod etp size
    padded_vocab_size: int = 0     # 0 = vocab rounded up to a multiple of tp_size
    last_stage_layers: int = 0     # layers on the last pipeline rank; 0 = even (core/dims.py stage_layer_counts)

    def __post_init__(self):
        for size, rank, name in ((self.tp_size, self.tp_rank, "tp"), (self.ep_size, self.ep_rank, "ep"),
                                 (self.pp_size, self.pp_rank, "pp"), (self.expert_tp_size, self.expert_tp_rank, "etp")):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"ShardLayout: {name}_rank {rank} is outside [0, {name}_size={size})")
        if self.vpp_size < 1:
            raise ValueError(f"ShardLayout: vpp_size {self.vpp_size} must be >= 1")

    @property
    def expert_tp_size(self) -> int:
        return self.etp_size or self.tp_size

    @property
    def expert_tp_rank(self) -> int:
        # etp=1 under tp>1: every TP rank holds whole experts (expert-TP rank 0).
        return self.tp_rank % self.expert_tp_size if self.etp_rank < 0 else self.etp_rank

    def dims(self) -> ParallelDims:
        """The layout these shards belong to, with the fewest data-parallel ranks that fit ep*etp."""
        expert = self.ep_size * self.expert_tp_size
        dp = expert // math.gcd(self.tp_size, expert)
        return ParallelDims(tp=self.tp_size, pp=self.pp_size, vpp=self.vpp_size, ep=self.ep_size,
                            etp=self.expert_tp_size, dp=dp, last_stage_layers=self.last_stage_layers)

    def padded_vocab(self, vocab_size: int) -> int:
        if self.padded_vocab_size:
            if self.padded_vocab_size < vocab_size or self.padded_vocab_size % self.tp_size:
                raise ValueError(f"padded_vocab_size {self.padded_vocab_size} must be >= vocab {vocab_size} "
                                 f"and a multiple of tp_size {self.tp_size}")
            return self.padded_vocab_size
        return -(-vocab_size // self.tp_size) * self.tp_size

    def layer_range(self, num_layers: int, vp_stage: int = 0) -> range:
        """Global decoder layers of virtual chunk `vp_stage` on this pipeline rank."""
        counts = self.dims().stage_layers(num_layers)
        if min(counts) < 1 or any(c % self.vpp_size for c in counts):
            raise ValueError(f"{num_layers} layers do not split over pp={self.pp_size} x vpp={self.vpp_size} "
                             f"(per pipeline rank: {counts}); fix: choose pp, vpp and last_stage_layers so that "
                             f"every rank's layers split over its vpp chunks")
        return layer_range(num_layers, self.pp_size, self.vpp_size, self.pp_rank, vp_stage, self.last_stage_layers)

    def expert_range(self, num_experts: int) -> range:
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not split over ep={self.ep_size}; fix: ep must divide it")
        n = num_experts // self.ep_size
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    def has_embedding(self, vp_stage: int) -> bool:
        return self.pp_rank == 0 and vp_stage == 0

    def has_output(self, vp_stage: int) -> bool:
        return self.pp_rank == self.pp_size - 1 and vp_stage == self.vpp_size - 1


def all_layouts(tp: int = 1, ep: int = 1, pp: int = 1, vpp: int = 1, **extra) -> Iterator[ShardLayout]:
    """Every distinct shard of a layout: one per (pp_rank, tp_rank, ep_rank). Ranks that differ only by
    data parallelism hold replicas and are not listed. With etp != tp, expert-TP ranks are listed too."""
    base = ShardLayout(tp_size=tp, ep_size=ep, pp_size=pp, vpp_size=vpp, **extra)
    for p, t, e in itertools.product(range(pp), range(tp), range(ep)):
        yield replace(base, pp_rank=p, tp_rank=t, ep_rank=e)
