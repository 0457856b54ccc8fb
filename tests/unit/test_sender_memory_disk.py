"""The disk sender's memory (issue 17.5): DiskWeightSync writes shards of weight_sync.bucket_mb (a
larger tensor alone) from the streamed export, so it holds one shard and the tensor being gathered,
never the model (it used to fill shards of 4 GiB: the whole model of anything this size); the peak
stays within what weight_sync.max_sender_mb counts for the disk method (sender_budget.py), and the
engine loads every tensor equal.

The peak is bench/parallel.py's LiveTensorPeak, entered in the thread that writes the shards; the
stream makes each tensor anew at its turn, as the export's TP gather does."""
from __future__ import annotations

import asyncio
import json

import pytest

from bench.parallel import LiveTensorPeak
from sao_megatron.core.config.sender_budget import MIB, sender_need


class _Into(LiveTensorPeak):
    """A worker thread's mode that counts into the push's mode (one peak over every thread)."""

    def __init__(self, parent: LiveTensorPeak):
        super().__init__()
        self.parent = parent

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.parent.__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("bucket_mb", [0.01, 0.1])
def test_disk_sender_holds_one_shard_within_the_bound(bucket_mb, tiny_model_dir, tmp_path, monkeypatch):
    """Measured 0.05 MB (bucket 0.01 MiB; the bound 0.26) and 0.13 MB (0.1 MiB; the bound 0.30) of a
    2.0 MB model."""
    from safetensors.torch import load_file

    import checkpoints.hf_io as hf_io
    from rollout.weights.check import check_weight_update_equal
    from rollout.weights.loopback_engine import LoopbackEngine
    from rollout.weights.sync import DiskWeightSync
    from sao_megatron.core.config import WeightSyncConfig

    hf = load_file(f"{tiny_model_dir}/model.safetensors")
    mode, save = LiveTensorPeak(), hf_io.save_hf_checkpoint

    def counted(*args):
        with _Into(mode):
            return save(*args)

    monkeypatch.setattr(hf_io, "save_hf_checkpoint", counted)

    async def push():
        engine = LoopbackEngine("e0")
        try:
            sync = DiskWeightSync(WeightSyncConfig(method="disk", bucket_mb=bucket_mb, timeout_s=120), [engine],
                                  tmp_path)
            with mode:
                await sync.push(((n, t.clone()) for n, t in hf.items()), version=1)
            return [c.compared for c in await check_weight_update_equal([engine], hf.items())]
        finally:
            await engine.close()

    compared = asyncio.run(push())
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    need = sender_need(cfg, bucket_mb * MIB, element_bytes=4, method="disk")
    model_bytes = sum(t.numel() * t.element_size() for t in hf.values())
    shards = list((tmp_path / "v1").glob("*.safetensors"))
    assert compared == [len(hf)]
    assert len(shards) >= model_bytes // max(bucket_mb * MIB, need.largest) // 2   # streamed shard by shard
    assert 0 < mode.peak <= need.total
    assert mode.peak < model_bytes / 3
