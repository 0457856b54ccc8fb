"""The shard-writes sender's memory (issue 17.5): ShardWriteSync's producer slices the streamed export
into per-rank buckets and its lanes flatten and send them, so the sender holds per lane two flat
buffers and three buckets of slices, one pending bucket per engine TP rank and the tensor being
gathered; each slice is copied out of its tensor, so no pending bucket pins a whole gathered tensor.
The peak stays within what weight_sync.max_sender_mb counts for shard_writes (rollout/weights/memory.py),
and the sender-memory check refuses a bound below it.

The peak is bench/parallel.py's LiveTensorPeak, entered in the producer's and every lane's thread
(calls.pinned); the stream makes each tensor anew at its turn, as the export's TP gather does. The
engine is a LoopbackShardEngine of TP 2 (two child processes that check and drop their slices)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from bench.parallel import CountInto, LiveTensorPeak
from rollout.weights.memory import MIB, SHARD_QUEUE_DEPTH, check_sender_memory, sender_need
from sao_megatron.core.config import ConfigError


@pytest.mark.parametrize("bucket_mb", [0.01, 0.1])
def test_shard_writes_sender_peak_stays_within_the_bound(bucket_mb, tiny_model_dir, monkeypatch):
    """Measured 0.21-0.22 MB (bucket 0.01 MiB; the bound 0.98) and 1.13-1.22 MB (0.1 MiB; the bound 1.45)
    of a 2.0 MB model, two lanes, one engine of TP 2 (twelve 0.1 MiB buckets are most of this model)."""
    from safetensors.torch import load_file

    from rollout.weights import calls, shard_writes as sharded
    from rollout.weights.loopback_engine import LoopbackShardEngine
    from rollout.weights.shard_plan import bytes_per_rank
    from sao_megatron.core.config import WeightSyncConfig

    hf = load_file(f"{tiny_model_dir}/model.safetensors")
    mode = LiveTensorPeak()

    def counted(device, fn, *args):
        with CountInto(mode):
            return calls.pinned(device, fn, *args)

    monkeypatch.setattr(sharded, "pinned", counted)

    async def push():
        engine = LoopbackShardEngine("e0", tp=2)
        try:
            cfg = WeightSyncConfig(method="shard_writes", bucket_mb=bucket_mb, shard_senders=2, timeout_s=120)
            sync = sharded.ShardWriteSync(cfg, [engine], ranks_per_engine=2)
            await sync.connect()
            with mode:
                async with sync.update_session():
                    await sync.push(((n, t.clone()) for n, t in hf.items()), version=1)
            await sync.close()
            return sync.received
        finally:
            await engine.close()

    received = asyncio.run(push())
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    need = sender_need(cfg, bucket_mb * MIB, element_bytes=4, method="shard_writes", lanes=2, targets=2)
    model_bytes = sum(t.numel() * t.element_size() for t in hf.values())
    assert [received[("e0", r)] for r in range(2)] == bytes_per_rank(hf.items(), 2)   # every slice landed
    assert 0 < mode.peak <= need.total
    if bucket_mb == 0.01:   # buckets well below the model: the sender holds a fraction of it
        assert mode.peak < model_bytes / 3


def test_sender_memory_check_counts_lanes_and_engine_ranks_for_shard_writes(tiny_model_dir):
    from parallel import layout_check as lc

    hf = json.loads((tiny_model_dir / "config.json").read_text())
    recipe = lc.make_recipe(tiny_model_dir, dict(tp=1))
    recipe.parallel = replace(recipe.parallel, world_size=1)
    recipe.rollout = replace(recipe.rollout, num_engines=2, engine_urls=[], engine_tp=2)
    bucket = 0.01
    need = sender_need(hf, bucket * MIB, element_bytes=4, method="shard_writes", lanes=2, targets=4)
    payload = max(bucket * MIB, need.largest)
    assert need.total == 2 * 2 * payload + ((SHARD_QUEUE_DEPTH + 1) * 2 + 4) * payload + need.gather
    recipe.weight_sync = replace(recipe.weight_sync, method="shard_writes", shard_senders=2, bucket_mb=bucket,
                                 max_sender_mb=need.total / MIB * 0.99)
    with pytest.raises(ConfigError) as err:
        check_sender_memory(recipe, hf)
    assert err.value.field == "weight_sync.max_sender_mb" and "shard_writes sender" in str(err.value)
    assert "\n" not in str(err.value)
    recipe.weight_sync = replace(recipe.weight_sync, max_sender_mb=need.total / MIB)
    check_sender_memory(recipe, hf)
    # the same bound holds a broadcast sender (one payload pair, no per-rank buckets)
    recipe.weight_sync = replace(recipe.weight_sync, method="broadcast", max_sender_mb=need.total / MIB * 0.99)
    check_sender_memory(recipe, hf)
