"""DiskWeightSync (weight_sync.method = "disk"): write HF safetensors shards, then
/update_weights_from_disk on every engine."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Optional

import torch

from .base import EngineSync
from .calls import run_all
from .fp8_blocks import Fp8Layout
from .receiver import WeightReceiver


class DiskWeightSync(EngineSync):
    """HF shards under disk_dir/v<version>, loaded by every engine; older versions are deleted.
    Shards of weight_sync.bucket_mb (a larger tensor alone): the sender holds one shard at a time
    (weight_sync.max_sender_mb counts it, memory.py).
    No session (SGLang's disk load needs none, and end_weight_update after it would post-process the
    loaded weights a second time); flush_cache=False, the window settles the cache."""

    def __init__(self, cfg, engines: list[WeightReceiver], disk_dir: str | Path, *,
                 aux_from: str | Path | None = None, dtype: Optional[torch.dtype] = None, keep: int = 1,
                 fp8: Optional[Fp8Layout] = None):
        super().__init__(cfg, engines, dtype, fp8)
        self.disk_dir, self.aux_from, self.keep = Path(disk_dir), aux_from, keep

    async def _transfer(self, named_tensors, version: int) -> None:
        from checkpoints.hf_io import save_hf_checkpoint

        path = self.disk_dir / f"v{version}"
        await asyncio.to_thread(save_hf_checkpoint, path, named_tensors, self.aux_from, self.cfg.bucket_mb)
        await run_all(self._each(lambda e: e.update_weights_from_disk(str(path), version, flush_cache=False)),
                      f"update_weights_from_disk({path})", self.cfg.timeout_s)
        old = sorted((p for p in self.disk_dir.glob("v*") if p != path and p.name[1:].isdigit()),
                     key=lambda p: int(p.name[1:]))
        for stale in old[: max(len(old) - (self.keep - 1), 0)]:
            shutil.rmtree(stale, ignore_errors=True)
