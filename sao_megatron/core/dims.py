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
- Layers (`stage_layer_counts`, `layer_range`): an even split when pp * vpp divides them; otherwise
  Megatron's uneven last stage (TransformerConfig.num_layers_in_last_pipeline_stage, the
  --decoder-last-pipeline-num-layers flag): every pipeline rank but the last holds m layers, the last
  holds the rest. m is ceil(L/pp) rounded up to a multiple of vpp unless `parallel.last_stage_layers`
  fixes the last stage's count (Megatron: the other ranks split the rest evenly). With vpp, each
  rank's count splits evenly over its vpp chunks (transformer_config.py __post_init__), and chunk v of
  rank r starts at v*L/vpp + (layers of ranks < r)/vpp (transformer_layer.get_transformer_layer_offset).
  The trainer, the planner and `sao convert` all place layers with these two functions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from .config.errors import ConfigError
from .shape import ArchShape


class LayoutError(ConfigError):
    """A parallel layout that cannot work: ``parallel.<field>: <problem>; fix: <fix>``."""


def stage_layer_counts(num_layers: int, pp: int, vpp: int = 1, last_stage_layers: int = 0) -> list[int]:
    """Layers of each pipeline rank (all its vpp chunks together): even when pp*vpp divides them, else
    m on every rank but the last, which takes the rest (78 over pp=4 -> 20,20,20,18). Not validated:
    a count may come out < 1 or not split over vpp; ParallelDims.validate says so."""
    if pp == 1:
        return [num_layers]
    if last_stage_layers:
        rest = num_layers - last_stage_layers
        return [rest // (pp - 1)] * (pp - 1) + [num_layers - (rest // (pp - 1)) * (pp - 1)]
    if num_layers % (pp * vpp) == 0:
        return [num_layers // pp] * pp
    m = math.ceil(math.ceil(num_layers / pp) / vpp) * vpp
    return [m] * (pp - 1) + [num_layers - m * (pp - 1)]


def layer_range(num_layers: int, pp: int, vpp: int, pp_rank: int, vp_stage: int = 0,
                last_stage_layers: int = 0) -> range:
    """Global ids of the decoder layers in virtual chunk `vp_stage` of pipeline rank `pp_rank`."""
    counts = stage_layer_counts(num_layers, pp, vpp, last_stage_layers)
    start = vp_stage * (num_layers // vpp) + sum(counts[:pp_rank]) // vpp
    return range(start, start + counts[pp_rank] // vpp)


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
    last_stage_layers: int = 0  # layers of the last pipeline rank; 0 = even split, else ceil (stage_layer_counts)

    @classmethod
    def from_config(cls, par, world_size: int) -> "ParallelDims":
        """From a recipe's ParallelConfig; dp=0 means world / (tp*pp*cp)."""
        dp = par.dp or max(world_size // (par.tp * par.pp * par.cp), 1)
        return cls(tp=par.tp, pp=par.pp, vpp=par.vpp, ep=par.ep, etp=par.etp or None, cp=par.cp, dp=dp,
                   sequence_parallel=par.sequence_parallel, last_stage_layers=par.last_stage_layers)

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

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers of each pipeline rank under this layout (stage_layer_counts)."""
        return stage_layer_counts(num_layers, self.pp, self.vpp, self.last_stage_layers)

    def layer_range(self, num_layers: int, pp_rank: int, vp_stage: int = 0) -> range:
        """Global layer ids of one virtual chunk of one pipeline rank (as Megatron places them)."""
        return layer_range(num_layers, self.pp, self.vpp, pp_rank, vp_stage, self.last_stage_layers)

    def megatron_last_stage_layers(self, num_layers: int) -> Optional[int]:
        """TransformerConfig.num_layers_in_last_pipeline_stage: None for an even split."""
        counts = self.stage_layers(num_layers)
        return None if len(set(counts)) == 1 else counts[-1]

    def short(self) -> str:
        return (f"tp{self.tp} pp{self.pp} cp{self.cp} ep{self.ep} etp{self.expert_tp}"
                + (f" vpp{self.vpp}" if self.vpp > 1 else ""))

    def validate(self, world_size: int, model: Optional[ArchShape] = None) -> "ParallelDims":
        """Check sizes against the world and (optionally) the model; return the resolved dims.

        Resolution: dp=0 becomes world / (tp*pp*cp); sequence parallel is forced on for MoE with
        tp > 1 (Megatron requires it) and off at tp = 1 (a TP feature).
        """
        self._check_sizes()
        dims = self._check_world(world_size)
        if model is not None:
            dims._check_model(model)
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

    def _check_model(self, model: ArchShape) -> None:
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
            self._check_layers(model.num_layers)

    def _check_layers(self, layers: int) -> None:
        last = self.last_stage_layers
        if last and self.pp == 1:
            raise LayoutError("parallel.last_stage_layers", f"{last} set with pp=1",
                              "set parallel.last_stage_layers = 0 (it places layers across pipeline ranks)")
        if last and not 0 < last < layers:
            raise LayoutError("parallel.last_stage_layers", f"{last} is not within 1..{layers - 1} "
                              f"(num_layers={layers})", "use 0 (automatic) or a count below num_layers")
        if last and (layers - last) % (self.pp - 1):
            raise LayoutError("parallel.last_stage_layers", f"the other {self.pp - 1} pipeline ranks cannot split "
                              f"the remaining {layers - last} of {layers} layers evenly",
                              "choose it so that pp-1 divides num_layers - last_stage_layers, or 0")
        counts = self.stage_layers(layers)
        if min(counts) < 1:
            raise LayoutError("parallel.pp", f"pp={self.pp} (vpp={self.vpp}) leaves a pipeline rank without "
                              f"layers (num_layers={layers}: {counts})", "lower pp or vpp, or set parallel.last_stage_layers")
        if any(c % self.vpp for c in counts):
            raise LayoutError("parallel.vpp", f"vpp={self.vpp} does not divide the layers of every pipeline rank "
                              f"({counts} of num_layers={layers})",
                              "choose vpp dividing each rank's layers, or set parallel.last_stage_layers")
