"""How BroadcastWeightSync keeps the wire busy (rollout/weights/broadcast.py, buckets.py): a bucket whose
tensors already lie in one run of memory goes without a copy, and the next bucket's broadcast leaves the
sender before the engines answered the one before."""
from __future__ import annotations

import asyncio
import math
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


def _megatron_buffer(layers: int = 2, experts: int = 4, pad: int = 0):
    """HF-named views of one parameter buffer laid out as Megatron's DDP lays out its params (the last
    parameter first; `pad` elements before each, its distributed optimizer's alignment), in the export's
    name order: per expert down (fc2), then gate and up (the halves of fc1)."""
    params = []   # Megatron's module order: per expert fc1 [gate; up], then fc2
    for layer in range(layers):
        for e in range(experts):
            params += [(f"model.layers.{layer}.mlp.experts.{e}.fc1", (2 * 8, 16)),
                       (f"model.layers.{layer}.mlp.experts.{e}.fc2", (16, 8))]
    total = sum(math.prod(s) + pad for _, s in params)
    buffer, offset, views = torch.randn(total).to(torch.bfloat16), 0, {}
    for name, shape in reversed(params):
        offset += pad
        views[name] = buffer[offset:offset + math.prod(shape)].view(shape)
        offset += math.prod(shape)
    named = []
    for layer in range(layers):
        for e in range(experts):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            fc1 = views[f"{p}.fc1"]
            named += [(f"{p}.down_proj.weight", views[f"{p}.fc2"]), (f"{p}.gate_proj.weight", fc1[:8]),
                      (f"{p}.up_proj.weight", fc1[8:])]
    return buffer, named


def _check_partition(buckets, named, bucket_bytes):
    sent = [n for b in buckets for n in b.names]
    assert sorted(sent) == sorted(n for n, _ in named)                       # each tensor exactly once
    assert all(b.nbytes <= bucket_bytes for b in buckets)
    for b in buckets:
        by_name = dict(named)
        assert all(t is by_name[n] for n, t in zip(b.names, b.tensors))


def test_views_of_a_reversed_parameter_buffer_go_in_runs_from_the_models_memory():
    """Megatron lays parameters out last first, the export walks them in name order: the views are held
    until they lie back to back, and each full run is a bucket sent from the buffer itself."""
    from rollout.weights.bucketing import iter_buckets

    buffer, named = _megatron_buffer()
    per_expert = 3 * 8 * 16 * 2
    bucket_bytes = 3 * per_expert
    buckets = list(iter_buckets(named, bucket_bytes, "cpu"))
    _check_partition(buckets, named, bucket_bytes)
    own = [b for b in buckets if b.in_place("cpu") is not None]
    assert sum(b.nbytes for b in own) >= 0.7 * buffer.numel() * 2 and len(own) >= 2
    for b in own:
        view = b.in_place("cpu")
        assert buffer.untyped_storage().data_ptr() <= view.data_ptr() < buffer.untyped_storage().data_ptr() + buffer.numel() * 2
        assert torch.equal(view, b.flatten())
    # without the payload device (or with another one) every bucket is copied, as before
    for device in (None, "meta"):
        copied = list(iter_buckets(named, bucket_bytes, device))
        _check_partition(copied, named, bucket_bytes)
        assert [n for b in copied for n in b.names] == [n for n, _ in named]


def test_padding_between_parameters_breaks_a_run_and_short_runs_are_copied():
    from rollout.weights.bucketing import iter_buckets

    _, named = _megatron_buffer(pad=64)     # every parameter starts after a gap: runs are one fc1 at most
    buckets = list(iter_buckets(named, 3 * 8 * 16 * 2 * 8, "cpu"))
    _check_partition(buckets, named, 3 * 8 * 16 * 2 * 8)
    assert all(b.in_place("cpu") is None for b in buckets)                   # fc1 (512 B) < bucket / 4


def test_a_tensor_that_must_share_a_call_with_a_view_before_it_takes_that_view_along():
    """An FP8 scale follows its weight into the same update call, even when the weight was a view about
    to close a run; fresh tensors (their own storage) are copied as before."""
    from rollout.weights.bucketing import iter_buckets
    from rollout.weights.fp8_blocks import SCALE_SUFFIX

    buffer, named = _megatron_buffer(layers=1, experts=2)
    last = named[-1][0]
    scale = (last + SCALE_SUFFIX, torch.ones(1, 1))
    tied = ("lm_head.weight", named[0][1])       # a tied weight: the same memory under a second name
    stream = named + [scale, ("model.norm.weight", torch.randn(16)), tied]
    for bucket_bytes in (8 * 16 * 2, 3 * 8 * 16 * 2, 1 << 20):
        buckets = list(iter_buckets(stream, bucket_bytes, "cpu"))
        _check_partition(buckets, stream, max(bucket_bytes, 8 * 16 * 2) + 4)   # a scale may pass the bound
        home = [b for b in buckets if scale[0] in b.names]
        assert len(home) == 1 and last in home[0].names
        norm = next(b for b in buckets if "model.norm.weight" in b.names)
        assert norm.in_place("cpu") is None or len(norm.names) == 1
        for b in buckets:                                                # no bytes twice in one payload
            spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in b.tensors)
            assert b.in_place("cpu") is None or all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))


def test_runs_of_the_parameter_buffer_arrive_bit_exact_and_the_buffer_is_untouched():
    buffer, named = _megatron_buffer(layers=3, experts=4)
    before = buffer.clone()
    stream = named + [("model.norm.weight", torch.randn(16)), ("lm_head.weight", torch.randn(24, 16))]

    async def scenario(engines):
        sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=3 * 8 * 16 * 2 * 2 / 2**20, timeout_s=60), engines)
        for version in (1, 2):
            async with sync.update_session():
                await sync.push(stream, version=version)
        got = {n: await engines[0].get_weights_by_name(n) for n, _ in stream}
        await sync.close()
        return got

    got = asyncio.run(run_then_close([FakeEngine("e0")], scenario))
    assert torch.equal(buffer, before)
    assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in stream)


def test_copying_a_live_parameter_leaves_its_storage_resizable():
    """The broadcast export yields views of live parameters; the flatten must not mark their storage as
    shared with numpy (Tensor.numpy() does: never resizable again), or the trainer's parking, which
    frees a parameter's storage between steps (resize_(0)), fails."""
    param = torch.nn.Parameter(torch.randn(8, 6))
    bucket = _bucket(param.data[2:5], param.data[:, :3])          # rows, and a strided column split
    flat = bucket.flatten()
    assert torch.equal(flat, torch.cat([param.data[2:5].reshape(-1), param.data[:, :3].reshape(-1)]).view(torch.uint8))
    param.data.untyped_storage().resize_(0)
    assert param.data.untyped_storage().nbytes() == 0


def test_without_a_snapshot_only_views_of_the_parameter_itself_pass_uncopied():
    """The packer may hold the export's views for a while: they must cost nothing, so the export yields
    views of the live parameter only; a part of a larger gathered tensor still owns exactly its bytes."""
    from parallel.weights import _own_storage

    param = torch.nn.Parameter(torch.randn(8, 4))
    gate = param.data[:4]
    assert _own_storage(gate, param, snapshot=False).data_ptr() == gate.data_ptr()
    assert _own_storage(gate, param).data_ptr() != gate.data_ptr()               # a snapshot copies it
    gathered = torch.cat([param.data, param.data])                             # a TP gather's merged tensor
    part = _own_storage(gathered[:8], param, snapshot=False)
    assert part.untyped_storage().nbytes() == part.nbytes and torch.equal(part, gathered[:8])
    whole = torch.randn(3)
    assert _own_storage(whole, param, snapshot=False) is whole


def test_a_run_sent_from_memory_is_the_payload_sglang_unflattens():
    """SGLang's FlattenedTensorBucket (weight_sync/tensor_bucket.py, pinned in test_sglang_contract_fp8) reads
    each tensor at the sum of the sizes before it in `names` order, at a multiple of its element size: a run
    sent from the model's memory lists its tensors in address order, back to back, one dtype."""
    from bench.weight_sync import synthetic_moe
    from rollout.weights.bucketing import iter_buckets
    from rollout.weights.broadcast import non_expert_first

    named = synthetic_moe(4, hidden=64, experts=4, inter=32)
    for bucket_bytes in (4096, 65536, 1 << 20):
        runs = [b for b in iter_buckets(non_expert_first(named, bucket_bytes), bucket_bytes, "cpu")
                if b.in_place("cpu") is not None]
        assert runs
        for bucket in runs:
            payload, offset = bucket.in_place("cpu"), 0
            names, dtypes, shapes = bucket.meta()
            for t, dtype, shape in zip(bucket.tensors, dtypes, shapes):
                size = math.prod(shape) * t.element_size()
                assert offset % t.element_size() == 0 and dtype == str(t.dtype).removeprefix("torch.")
                assert torch.equal(payload[offset:offset + size].view(t.dtype).view(shape), t)
                offset += size
            assert offset == payload.numel()
