"""Which layouts can run a model, and which layers each pipeline stage holds.

A layout is the planner's view of parallel.tp/pp/ep/etp/cp/vpp; `layout_problem` is its divisibility
check (heads over TP, experts over EP, ranks over the model-parallel product, layers over stages).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..model_shapes import is_mla, num_experts


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float  # what torch.cuda.mem_get_info reports as total on an idle device


GPUS = {"h100": GpuSpec("h100", 79.6), "h200": GpuSpec("h200", 139.8)}


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    vpp: int = 1

    def dp(self, world: int) -> int:
        return world // (self.tp * self.pp * self.cp)

    def expert_dp(self, world: int) -> int:
        return world // (self.pp * self.ep * self.etp)

    def short(self) -> str:
        return f"tp{self.tp} pp{self.pp} cp{self.cp} ep{self.ep} etp{self.etp}" + (f" vpp{self.vpp}" if self.vpp > 1 else "")


def layout_problem(cfg: dict, layout: Layout, world: int) -> str:
    """Why `layout` cannot run this model on `world` ranks ('' when it can)."""
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    base = layout.tp * layout.pp * layout.cp
    if world % base:
        return f"tp·pp·cp = {base} does not divide {world} ranks"
    if heads % layout.tp or (not is_mla(cfg) and kv % layout.tp):
        return f"tp={layout.tp} does not divide {heads} heads / {kv} kv heads"
    experts = num_experts(cfg)
    if experts and experts % layout.ep:
        return f"ep={layout.ep} does not divide {experts} experts"
    if (world // layout.pp) % (layout.ep * layout.etp):
        return f"ep·etp = {layout.ep * layout.etp} does not divide the {world // layout.pp} ranks of a stage"
    if min(stage_layer_counts(cfg["num_hidden_layers"], layout.pp * layout.vpp)) < 1:
        return f"pp·vpp = {layout.pp * layout.vpp} leaves a stage without layers ({cfg['num_hidden_layers']} layers)"
    return ""


def stage_layer_counts(num_layers: int, stages: int) -> list[int]:
    """ceil(L/stages) layers on every stage but the last, which takes the rest (78 over 4 -> 20,20,20,18)."""
    first = math.ceil(num_layers / stages)
    return [first] * (stages - 1) + [num_layers - first * (stages - 1)]


def stage_ranges(num_layers: int, pp: int, vpp: int = 1) -> list[list[int]]:
    """Layer indices held by each pipeline rank (virtual chunks interleave: chunk c goes to rank c % pp)."""
    counts = stage_layer_counts(num_layers, pp * vpp)
    starts = list(itertools.accumulate([0] + counts))
    ranks: list[list[int]] = [[] for _ in range(pp)]
    for chunk, count in enumerate(counts):
        ranks[chunk % pp].extend(range(starts[chunk], starts[chunk] + count))
    return ranks
