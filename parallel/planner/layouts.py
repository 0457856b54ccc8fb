"""Which layouts can run a model, and which layers each pipeline stage holds.

A planner layout is a `ParallelDims` (sao_megatron/core/dims.py) whose dp is left to the world
(dp=0) and whose etp is explicit (1 unless given). `layout_problem` asks ParallelDims.validate, the
one copy of the layout rules, including Megatron's uneven last pipeline stage.
"""
from __future__ import annotations

from sao_megatron.core.dims import LayoutError, ParallelDims, layer_range, stage_layer_counts
from sao_megatron.core.shape import shape_from_hf

from .hardware import GPUS, GpuSpec  # noqa: F401  (the GPU table lives in hardware.py; re-exported here)


def Layout(tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1, cp: int = 1, vpp: int = 1,  # noqa: N802
           last_stage_layers: int = 0) -> ParallelDims:
    """A planner layout: ParallelDims with dp resolved from the world and etp = 1 unless given."""
    return ParallelDims(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, cp=cp, dp=0, last_stage_layers=last_stage_layers)


def layout_problem(cfg: dict, layout: ParallelDims, world: int) -> str:
    """Why `layout` cannot run this model on `world` ranks ('' when it can): ParallelDims.validate's message."""
    try:
        layout.validate(world, shape_from_hf(cfg))
    except LayoutError as err:
        return str(err)
    return ""


def stage_ranges(num_layers: int, pp: int, vpp: int = 1, last_stage_layers: int = 0) -> list[list[int]]:
    """Layer indices held by each pipeline rank, all its virtual chunks (core/dims.py layer_range)."""
    return [[i for v in range(vpp) for i in layer_range(num_layers, pp, vpp, r, v, last_stage_layers)]
            for r in range(pp)]
