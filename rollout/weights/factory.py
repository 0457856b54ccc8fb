"""build_weight_sync: the transport named by weight_sync.method, for one sender role (plan.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from .base import WeightSync
from .fp8_blocks import Fp8Layout
from .plan import SenderRole
from .receiver import WeightReceiver

METHODS = ("broadcast", "shard_writes", "disk")
DRIVER = SenderRole(rank=0, kind="rank0", scope="all")   # a lone sender: bench, tests, a single-rank trainer


def build_weight_sync(cfg, engines: list[WeightReceiver], run_dir: str | Path | None = None, *,
                      ranks_per_engine: int | Sequence[int] = 1, role: SenderRole = DRIVER,
                      fp8: Optional[Fp8Layout] = None, aux_from: str | Path | None = None, **options) -> WeightSync:
    """The WeightSync named by cfg.method ("broadcast" | "shard_writes" | "disk") for `role`; `options`
    (master_address, dtype, senders, keep) go to its constructor. `ranks_per_engine` (each engine's TP
    size) shapes the broadcast and shard groups; `fp8` (engines serving FP8 blocks) is for broadcast and
    disk; `aux_from` (the model directory whose tokenizer and config files join each disk version) for disk."""
    if cfg.method == "broadcast":
        from .broadcast import BroadcastWeightSync

        return BroadcastWeightSync(cfg, engines, ranks_per_engine=ranks_per_engine, stage=role.stage, fp8=fp8,
                                   **options)
    if cfg.method == "shard_writes":
        from .shard_writes import ShardWriteSync

        if fp8 is not None:   # the recipe check refuses it first (trainer/engines.py)
            raise ValueError("weight_sync.method = 'shard_writes' does not slice FP8 blocks and their scales per "
                             "rank; fix: use weight_sync.method = 'broadcast' with rollout.engine_fp8")
        return ShardWriteSync(cfg, engines, ranks_per_engine=ranks_per_engine,
                              labels_versions=role.labels_versions, **options)
    if cfg.method == "disk":
        from .disk import DiskWeightSync

        disk_dir = cfg.disk_dir or (Path(run_dir) / "weights" if run_dir is not None else "")
        if not disk_dir:
            raise ValueError("weight_sync.disk_dir is empty and no run_dir was given; fix: set weight_sync.disk_dir")
        return DiskWeightSync(cfg, engines, disk_dir, aux_from=aux_from, fp8=fp8, **options)
    raise ValueError(f"weight_sync.method {cfg.method!r} unknown; fix: use 'broadcast', 'shard_writes' or 'disk'")
