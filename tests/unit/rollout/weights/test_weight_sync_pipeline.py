"""How BroadcastWeightSync keeps the wire busy (rollout/weights/broadcast.py, buckets.py): a bucket whose
tensors already lie in one run of memory goes without a copy, and the next bucket's broadcast leaves the
sender before the engines answered the one before."""
from __future__ import annotations

import asyncio
import time

import torch

from rollout.weights import BroadcastWeightSync
from rollout.weights import broadcast as weight_sync
from rollout.weights.buckets import Bucket
from sao_megatron.core.config import WeightSyncConfig

from weight_sync_fakes import FakeEngine, run_then_close


def _bucket(*tensors) -> Bucket:
    bucket = Bucket([], [])
    for i, t in enumerate(tensors):
        bucket.add(f"t{i}", t)
    return bucket


def test_a_bucket_in_one_run_of_memory_is_sent_from_that_memory():
    alone = torch.randn(10, 3)
    view = _bucket(alone).in_place("cpu")
    assert view.data_ptr() == alone.data_ptr() and torch.equal(view, _bucket(alone).flatten())
    buffer = torch.randn(100)
    run = _bucket(buffer[10:30].view(4, 5), buffer[30:40])          # views of one buffer, back to back
    assert run.in_place("cpu").data_ptr() == buffer[10:].data_ptr() and torch.equal(run.in_place("cpu"), run.flatten())
    param = torch.nn.Parameter(torch.randn(3, 3))
    assert torch.equal(_bucket(param).in_place("cpu"), _bucket(param).flatten())
    assert _bucket(buffer[10:30], buffer[31:40]).in_place("cpu") is None            # a gap
    assert _bucket(buffer[30:40], buffer[10:30]).in_place("cpu") is None            # out of order
    assert _bucket(torch.randn(4), torch.randn(4)).in_place("cpu") is None          # two storages
    assert _bucket(torch.randn(4, 4).t()).in_place("cpu") is None                   # not contiguous
    assert _bucket(torch.randn(4)).in_place("meta") is None                         # not on the payload device


def _named():
    g = torch.Generator().manual_seed(2)
    return [("model.embed_tokens.weight", torch.randn(96, 64, generator=g)),        # 24 KiB: alone, in place
            ("model.layers.0.self_attn.o_proj.weight", torch.randn(32, 64, generator=g)),
            ("model.layers.0.input_layernorm.weight", torch.randn(64, generator=g)),
            ("model.norm.weight", torch.randn(64, generator=g).to(torch.bfloat16)),
            ("lm_head.weight", torch.randn(96, 64, generator=g))]


def test_in_place_buckets_arrive_bit_exact_and_are_never_written_to():
    """Buckets sent from the tensors' own memory sit between flattened ones: a reused flatten buffer must
    never be one of them (the next flatten would overwrite the model)."""
    named = _named()
    before = [t.clone() for _, t in named]

    async def scenario(engines):
        sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=0.01, timeout_s=60), engines)
        for version in (1, 2):
            async with sync.update_session():
                await sync.push(named, version=version)
        got = [await engines[0].get_weights_by_name(n) for n, _ in named]
        await sync.close()
        return got

    got = asyncio.run(run_then_close([FakeEngine("e0")], scenario))
    assert all(torch.equal(t, b) for (_, t), b in zip(named, before))
    assert all(torch.equal(g, b) and g.dtype == b.dtype for g, b in zip(got, before))


def test_the_next_bucket_leaves_the_sender_before_the_engines_answer(monkeypatch):
    """The sender does not wait for the engines' replies to bucket i to broadcast bucket i+1 (its bytes wait
    in the socket buffers); the engines still get bucket i+1's call only after answering bucket i."""
    events = []
    real = weight_sync.broadcast_flat

    def wire(flat, group):
        events.append(("wire", time.monotonic()))
        real(flat, group)

    class SlowReply(FakeEngine):
        async def update_weights_from_distributed(self, *args, **kwargs):
            events.append(("call", time.monotonic()))
            await super().update_weights_from_distributed(*args, **kwargs)
            await asyncio.sleep(0.5)             # a slow HTTP reply after the engine has the bytes
            events.append(("answer", time.monotonic()))

    monkeypatch.setattr(weight_sync, "broadcast_flat", wire)

    async def scenario(engines):
        sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=0.01, timeout_s=60), engines)
        await sync.connect()
        async with sync.update_session():
            await sync.push(_named(), version=1)
        got = await engines[0].get_weights_by_name("lm_head.weight")
        await sync.close()
        return got

    got = asyncio.run(run_then_close([SlowReply("slow")], scenario))
    assert torch.equal(got, _named()[-1][1])
    times = {kind: [t for k, t in events if k == kind] for kind in ("wire", "call", "answer")}
    assert len(times["wire"]) == len(times["call"]) == len(times["answer"]) >= 3
    assert times["wire"][1] < times["answer"][0]                        # bucket 1 left before bucket 0's reply
    assert all(c > a for c, a in zip(times["call"][1:], times["answer"]))   # one call at a time, in order


def test_the_wire_thread_runs_calls_in_order_and_none_after_a_failure():
    """A push's broadcasts run back to back in one thread, in the order submitted; after a failed (or
    cancelled) one, the later ones fail without running: they would meet the peers' next collectives."""
    from rollout.weights.calls import SerialThread

    ran = []

    def call(i):
        ran.append(i)
        if i == 2:
            raise ValueError("peer gone")
        return i

    async def scenario():
        wire = SerialThread("weight-sync-test")
        futures = [wire.submit(call, i) for i in range(4)]
        wire.close()
        return await asyncio.gather(*futures, return_exceptions=True)

    outcomes = asyncio.run(scenario())
    assert outcomes[:2] == [0, 1] and ran == [0, 1, 2]
    assert isinstance(outcomes[2], ValueError)
    assert isinstance(outcomes[3], RuntimeError) and "earlier call in this thread failed (ValueError: peer gone)" \
        in str(outcomes[3])
