"""The disk sender's memory (issue 17.5): DiskWeightSync writes shards of weight_sync.bucket_mb (a
larger tensor alone) from the streamed export, so it holds one shard and the tensor being gathered,
never the model (it used to fill shards of 4 GiB: the whole model of anything this size); the peak
stays within what weight_sync.max_sender_mb counts for the disk method (rollout/weights/memory.py), and the
engine loads every tensor equal.

The peak is bench/parallel.py's LiveTensorPeak, entered in the thread that writes the shards; the
stream makes each tensor anew at its turn, as the export's TP gather does."""
from __future__ import annotations

import json

import pytest
from disk_push import disk_push_peak

from rollout.weights.memory import MIB, sender_need


@pytest.mark.parametrize("bucket_mb", [0.01, 0.1])
def test_disk_sender_holds_one_shard_within_the_bound(bucket_mb, tiny_model_dir, tmp_path, monkeypatch):
    """Measured 0.05 MB (bucket 0.01 MiB; the bound 0.26) and 0.13 MB (0.1 MiB; the bound 0.30) of a
    2.0 MB model."""
    from safetensors.torch import load_file

    from rollout.weights.check import check_weight_update_equal

    expected = load_file(f"{tiny_model_dir}/model.safetensors")

    async def compare(engine):
        return [c.compared for c in await check_weight_update_equal([engine], expected.items())]

    peak, hf, compared = disk_push_peak(tiny_model_dir, tmp_path, monkeypatch, bucket_mb, after=compare)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    need = sender_need(cfg, bucket_mb * MIB, element_bytes=4, method="disk")
    model_bytes = sum(t.numel() * t.element_size() for t in hf.values())
    shards = list((tmp_path / "v1").glob("*.safetensors"))
    assert compared == [len(hf)]
    assert len(shards) >= model_bytes // max(bucket_mb * MIB, need.largest) // 2   # streamed shard by shard
    assert 0 < peak <= need.total
    assert peak < model_bytes / 3
