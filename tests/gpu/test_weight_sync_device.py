"""The sender's payload stays on the local rank's GPU (issue 14 l). The current CUDA device is per
thread and a new thread starts on cuda:0, so BroadcastWeightSync captures the device in the pushing
thread (payload_device) and makes it current in its flatten and broadcast threads (pinned).
Meaningful with two or more GPUs (the rank's device is then not cuda:0); with one it checks the
plumbing. CUDA only (auto-skipped elsewhere by tests/conftest.py).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollout.weights.bucketing import iter_buckets
from rollout.weights.calls import in_daemon_thread, payload_device, pinned

pytestmark = pytest.mark.gpu


def test_worker_threads_use_the_captured_device():
    rank_device = torch.cuda.device_count() - 1          # a "local rank != 0" when there are 2+ GPUs
    torch.cuda.set_device(rank_device)
    device = payload_device("nccl")
    assert device == torch.device("cuda", rank_device)
    named = [("w", torch.ones(3, device=device)), ("b", torch.ones(3, dtype=torch.bfloat16, device=device))]
    (bucket,) = iter_buckets(named, 1 << 20)

    def flatten_thread():
        fresh = torch.cuda.current_device()              # what a new thread starts on
        flat = pinned(device, bucket.flatten, device, None)
        plain = torch.empty(1, device="cuda")            # a plain "cuda" allocation in the pinned thread
        return fresh, flat.device, plain.device

    with ThreadPoolExecutor(1) as pool:
        fresh, flat_device, plain_device = pool.submit(flatten_thread).result()
    assert flat_device == device and plain_device == device
    if rank_device != 0:
        assert fresh == 0     # why the pinning is needed

    async def broadcast_thread():
        return await in_daemon_thread(pinned, device, lambda: torch.empty(1, device="cuda").device)

    assert asyncio.run(broadcast_thread()) == device
