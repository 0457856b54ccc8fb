"""ParallelDims: the one layout record, and the one place the parallel-layout rules are written.

Rank order follows Megatron's default ``tp-cp-ep-dp-pp``. World = tp * cp * pp * dp; the expert
layout re-slices the same ranks as etp * ep * edp * pp (edp = expert data parallel).

`ParallelDims.validate(world_size, shape)` is called by the recipe check (core/config/recipe.py),
the trainer before any collective (parallel/rl_model.py), the planner (parallel/planner/layouts.py),
`sao convert` (checkpoints/mcore_io.py) and `sao doctor` (parallel/layout_check.py). Every failure
is a `LayoutError`, a ConfigError naming the recipe field and the fix. The rules and their sources
(Megatron-Core 0.16.1):

- tp divides the attention heads (TransformerConfig.__post_init__).
- GQA: tp divides the KV heads. Megatron also accepts tp a multiple of the KV heads (it replicates
  them), but the HF<->Megatron shard map splits whole KV groups, so we do not. MLA (GLM-5,
  DeepSeek-V3) has no KV-head groups: its per-head K/V come from one shared latent, and the GLM-5
  spec sets num_query_groups = num_attention_heads, so only the heads rule applies.
- ep divides the routed experts (moe_layer.py: num_moe_experts % ep_size); ep > 1 needs experts.
- ep * etp divides the ranks of one pipeline stage, world / pp (the expert grid etp*ep*edp*pp).
- Layers: pp * vpp divides them (the trainer's even split, get_transformer_layer_offset). The
  planner also plans Megatron's uneven split (ceil(L/stages) layers on every stage but the last,
  --decoder-last-pipeline-num-layers), which the trainer does not configure: `uneven_last_stage`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from .config.errors import ConfigError
from .shape import ArchShape


class LayoutError(ConfigError):
    """A parallel layout that cannot work: ``parallel.<field>: <problem>; fix: <fix>``."""


def stage_layer_counts(num_layers: int, stages: int) -> list[int]:
    """ceil(L/stages) layers on every stage but the last, which takes the rest (78 over 4 -> 20,20,20,18)."""
    first = math.ceil(num_layers / stages)
    return [first] * (stages - 1) + [num_layers - first * (stages - 1)]


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: Optional[int] = None   # None = same as tp (etp=1 with tp>1 silently drops expert grad sums on CPU)
    cp: int = 1
    dp: int = 1                 # 0 = whatever the world leaves: world / (tp*pp*cp), resolved by validate
    sequence_parallel: bool = False

    @classmethod
    def from_config(cls, par, world_size: int) -> "ParallelDims":
        """From a recipe's ParallelConfig; dp=0 means world / (tp*pp*cp)."""
        dp = par.dp or max(world_size // (par.tp * par.pp * par.cp), 1)
        return cls(tp=par.tp, pp=par.pp, vpp=par.vpp, ep=par.ep, etp=par.etp or None, cp=par.cp, dp=dp,
                   sequence_parallel=par.sequence_parallel)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @property
    def vpp_or_none(self) -> Optional[int]:
        return self.vpp if self.vpp > 1 else None

    def data_parallel(self, world: int) -> int:
        return world // (self.tp * self.pp * self.cp)

    def expert_data_parallel(self, world: int) -> int:
        return world // (self.pp * self.ep * self.expert_tp)

    def short(self) -> str:
        return (f"tp{self.tp} pp{self.pp} cp{self.cp} ep{self.ep} etp{self.expert_tp}"
                + (f" vpp{self.vpp}" if self.vpp > 1 else ""))

    def validate(self, world_size: int, model: Optional[ArchShape] = None,
                 uneven_last_stage: bool = False) -> "ParallelDims":
        """Check sizes against the world and (optionally) the model; return the resolved dims.

        Resolution: dp=0 becomes world / (tp*pp*cp); sequence parallel is forced on for MoE with
        tp > 1 (Megatron requires it) and off at tp = 1 (a TP feature).
        """
        self._check_sizes()
        dims = self._check_world(world_size)
        if model is not None:
            dims._check_model(model, uneven_last_stage)
            if model.num_experts and dims.tp > 1 and not dims.sequence_parallel:
                dims = replace(dims, sequence_parallel=True)
        if dims.tp == 1 and dims.sequence_parallel:
            dims = replace(dims, sequence_parallel=False)
        return dims

    def _check_sizes(self) -> None:
        for name in ("tp", "pp", "vpp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel.{name}", f"{getattr(self, name)} < 1", "use 1 or more")
        if self.etp is not None and self.etp < 1:
            raise LayoutError("parallel.etp", f"{self.etp} < 1", "use 0 (= tp) or more")
        if self.dp < 0:
            raise LayoutError("parallel.dp", f"{self.dp} < 0", "use 0 (auto) or more")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError("parallel.vpp", "vpp > 1 needs parallel.pp > 1", "set parallel.pp > 1 or parallel.vpp = 1")

    def _check_world(self, world: int) -> "ParallelDims":
        base = self.tp * self.pp * self.cp
        if world % base:
            raise LayoutError("parallel.world_size", f"{world} is not divisible by tp*pp*cp = {base}",
                              "make world_size a multiple of tp*pp*cp")
        dims = self if self.dp else replace(self, dp=world // base)
        if dims.world_size != world:
            raise LayoutError("parallel.dp", f"tp*cp*pp*dp = {dims.tp}*{dims.cp}*{dims.pp}*{dims.dp} = "
                              f"{dims.world_size} != world_size {world}",
                              "set parallel.dp = 0 (auto) or make the product equal world_size")
        stage = world // self.pp
        if stage % (self.ep * self.expert_tp):
            raise LayoutError("parallel.ep", f"ep={self.ep} x etp={self.expert_tp} does not divide the {stage} "
                              "ranks of a stage (world_size/pp)", "choose ep (and etp) so that ep*etp divides them")
        return dims

    def _check_model(self, model: ArchShape, uneven_last_stage: bool) -> None:
        if model.num_heads and model.num_heads % self.tp:
            raise LayoutError("parallel.tp", f"tp={self.tp} does not divide {model.num_heads} attention heads",
                              "choose tp dividing the head count")
        if not model.mla and model.num_kv_heads and model.num_kv_heads % self.tp:
            raise LayoutError("parallel.tp", f"tp={self.tp} does not divide num_key_value_heads={model.num_kv_heads} "
                              "kv heads (each TP rank holds whole KV groups)", "lower tp to a divisor of it")
        if model.num_experts and model.num_experts % self.ep:
            raise LayoutError("parallel.ep", f"ep={self.ep} does not divide num_experts={model.num_experts} "
                              "routed experts", "choose ep dividing the expert count")
        if not model.num_experts and self.ep > 1:
            raise LayoutError("parallel.ep", f"ep={self.ep} but the model has no experts", "set parallel.ep = 1")
        if model.num_layers:
            self._check_layers(model.num_layers, uneven_last_stage)

    def _check_layers(self, layers: int, uneven_last_stage: bool) -> None:
        stages = self.pp * self.vpp
        if uneven_last_stage:
            if min(stage_layer_counts(layers, stages)) < 1:
                raise LayoutError("parallel.pp", f"pp*vpp={stages} leaves a stage without layers "
                                  f"(num_layers={layers})", "lower pp or vpp")
        elif layers % stages:
            raise LayoutError("parallel.pp", f"pp*vpp={stages} does not divide num_layers={layers} layers",
                              "choose pp and vpp so that every stage gets the same number of layers")
