"""ParallelDims: the trainer's layout, validated against the world and the model before any collective.

Rank order follows Megatron's default ``tp-cp-ep-dp-pp``. World = tp * cp * pp * dp; the expert
layout re-slices the same ranks as etp * ep * edp * pp (edp = expert data parallel).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message names the field and the fix."""


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: Optional[int] = None   # None = same as tp (etp=1 with tp>1 silently drops expert grad sums on CPU)
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False

    @classmethod
    def from_config(cls, par, world_size: int) -> "ParallelDims":
        """From a recipe's ParallelConfig; dp=0 means world / (tp*pp*cp)."""
        base = par.tp * par.pp * par.cp
        dp = par.dp or max(world_size // base, 1)
        dims = cls(tp=par.tp, pp=par.pp, vpp=par.vpp, ep=par.ep, etp=par.etp or None, cp=par.cp, dp=dp,
                   sequence_parallel=par.sequence_parallel)
        return dims

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @property
    def vpp_or_none(self) -> Optional[int]:
        return self.vpp if self.vpp > 1 else None

    def validate(self, world_size: int, model=None) -> "ParallelDims":
        """Check sizes against the world and (optionally) a ModelShape; return the resolved dims.

        Resolution: sequence parallel is forced on for MoE with tp > 1 (Megatron requires it).
        """
        for name in ("tp", "pp", "vpp", "ep", "cp", "dp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel.{name}={getattr(self, name)} < 1; use 1 or more")
        if self.world_size != world_size:
            raise LayoutError(f"parallel: tp*cp*pp*dp = {self.tp}*{self.cp}*{self.pp}*{self.dp} = {self.world_size} "
                              f"but the world has {world_size} ranks; change parallel.dp or the rank count")
        expert_dp, rem = divmod(self.tp * self.cp * self.dp, self.expert_tp * self.ep)
        if rem or expert_dp < 1:
            raise LayoutError(f"parallel.ep={self.ep} x etp={self.expert_tp} does not divide tp*cp*dp="
                              f"{self.tp * self.cp * self.dp}; pick ep so that ep*etp divides it")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError("parallel.vpp > 1 needs parallel.pp > 1; set vpp = 1 or raise pp")
        dims = self
        if model is not None:
            dims._check_model(model)
            if model.num_experts and self.tp > 1 and not self.sequence_parallel:
                dims = replace(dims, sequence_parallel=True)
        if dims.tp == 1 and dims.sequence_parallel:
            dims = replace(dims, sequence_parallel=False)  # SP is a TP feature: a no-op flag at tp=1
        return dims

    def _check_model(self, model) -> None:
        """model: anything with num_heads, num_kv_heads, num_layers, num_experts, vocab_size."""
        if model.num_heads % self.tp:
            raise LayoutError(f"parallel.tp={self.tp} does not divide num_attention_heads={model.num_heads}")
        if model.num_kv_heads % self.tp:
            raise LayoutError(f"parallel.tp={self.tp} does not divide num_key_value_heads={model.num_kv_heads} "
                              f"(Megatron splits whole KV groups); lower tp")
        if model.num_experts and model.num_experts % self.ep:
            raise LayoutError(f"parallel.ep={self.ep} does not divide num_experts={model.num_experts}")
        if not model.num_experts and self.ep > 1:
            raise LayoutError(f"parallel.ep={self.ep} but the model has no experts; set ep = 1")
        stages = self.pp * self.vpp
        if model.num_layers % stages:
            raise LayoutError(f"parallel.pp*vpp={stages} does not divide num_layers={model.num_layers}")
        if model.num_layers < stages:
            raise LayoutError(f"parallel.pp*vpp={stages} exceeds num_layers={model.num_layers}")
