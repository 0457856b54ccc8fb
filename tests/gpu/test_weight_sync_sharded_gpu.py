"""Shard writes from a GPU trainer (issue 17.4). The trainer's export is on its GPU: a lane flattens
GPU slices into a CPU payload for gloo (one device-to-host copy per slice, strided row splits
included) or into a GPU payload for nccl; over gloo to LoopbackShardEngine ranks (engine TP 2) every
rank acks exactly its slice's bytes. NCCL lanes need a GPU per group member, so the wire itself is
checked here with gloo. CUDA only (auto-skipped elsewhere by tests/conftest.py).
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from rollout.weights.buckets import Bucket
from rollout.weights.shard_plan import bytes_per_rank, shard_of
from rollout.weights.shard_writes import flatten_slices

pytestmark = pytest.mark.gpu


def _bucket(device) -> Bucket:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 48, generator=g).to(torch.bfloat16).to(device)
    bucket = Bucket([], [])
    bucket.add("l.o_proj.weight", shard_of("l.o_proj.weight", w, 2, 1))     # strided columns
    bucket.add("l.q_proj.weight", shard_of("l.q_proj.weight", w, 2, 0))     # contiguous rows
    bucket.add("l.norm.weight", torch.randn(48, generator=g).to(device))
    return bucket.aligned()


@pytest.mark.parametrize("payload", ["cpu", "cuda"])
def test_gpu_slices_flatten_to_the_same_bytes_as_on_the_cpu(payload):
    expected, _ = flatten_slices(_bucket("cpu"), None, "cpu")
    flat, _ = flatten_slices(_bucket("cuda"), None, payload)
    assert flat.device.type == payload and torch.equal(flat.cpu(), expected)


def test_gloo_lanes_from_gpu_tensors_write_each_rank_its_slice():
    from bench.weight_sync import synthetic_moe
    from rollout.weights.loopback_engine import LoopbackShardEngine
    from rollout.weights.shard_writes import ShardWriteSync
    from sao_megatron.core.config import WeightSyncConfig

    named = [(n, t.cuda()) for n, t in synthetic_moe(8, layout="separate")]

    async def scenario():
        engine = LoopbackShardEngine("gpu-loopback", 2)
        try:
            sync = ShardWriteSync(WeightSyncConfig(method="shard_writes", backend="gloo", bucket_mb=1,
                                                   timeout_s=120), [engine], ranks_per_engine=2, senders=2)
            async with sync.update_session():
                await sync.push(named, version=4)
            await sync.close()
            return dict(sync.received), await engine.weight_version()
        finally:
            await engine.close()

    received, version = asyncio.run(scenario())
    per_rank = bytes_per_rank(named, 2)
    assert received == {("gpu-loopback", 0): per_rank[0], ("gpu-loopback", 1): per_rank[1]} and version == 4
