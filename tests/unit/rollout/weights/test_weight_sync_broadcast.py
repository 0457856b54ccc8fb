"""BroadcastWeightSync / DiskWeightSync against in-process fake engines over a real gloo group."""
from __future__ import annotations

import asyncio

import pytest
import torch

from rollout.engines.engine import EngineError
from rollout.weights.bucketing import iter_buckets
from rollout.weights.buckets import Bucket
from rollout.weights.check import WeightMismatchError, check_weight_update_equal
from rollout.weights import BroadcastWeightSync, DiskWeightSync, build_weight_sync
from rollout.weights.broadcast import non_expert_first
from sao_megatron.core.config import WeightSyncConfig

from weight_sync_fakes import FakeEngine, run_then_close


def _named():
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(105, 64, generator=g)),
            ("model.layers.0.mlp.experts.3.up_proj.weight", torch.randn(64, 64, generator=g)),
            ("model.layers.0.self_attn.q_proj.weight", torch.randn(128, 64, generator=g).to(torch.bfloat16)),
            ("model.layers.0.mlp.gate.weight", torch.randn(8, 64, generator=g)),
            ("model.layers.1.mlp.experts.0.down_proj.weight", torch.randn(64, 32, generator=g)),
            ("model.norm.weight", torch.randn(64, generator=g))]


def test_buckets_respect_size_and_order():
    named = _named()
    buckets = list(iter_buckets(named, bucket_bytes=64 * 64 * 4 + 10))
    assert [n for b in buckets for n in b.names] == [n for n, _ in named]
    assert all(b.nbytes <= 64 * 64 * 4 + 10 or len(b.names) == 1 for b in buckets)
    b = Bucket([], [])
    b.add("a", torch.tensor([1.0]))
    b.add("b", torch.tensor([2], dtype=torch.int16))
    assert b.nbytes == 6 and torch.equal(b.flatten(out=torch.full((9,), 7, dtype=torch.uint8)), b.flatten())
    assert b.flatten().tolist() == list(torch.tensor([1.0]).view(torch.uint8).tolist()) + [2, 0]
    assert b.meta() == (["a", "b"], ["float32", "int16"], [[1], [1]])


def test_bucket_offsets_meet_sglangs_alignment_check():
    """An odd-length bf16 tensor before an fp32 one would put the fp32 at byte offset 6, which SGLang's
    FlattenedTensorBucket.empty refuses; the bucket lists larger element sizes first."""
    named = [("a.bf16", torch.ones(3, dtype=torch.bfloat16)), ("b.fp32", torch.arange(2.0)),
             ("c.int8", torch.ones(1, dtype=torch.int8)), ("d.fp64", torch.ones(1, dtype=torch.float64))]
    (bucket,) = iter_buckets(named, bucket_bytes=1 << 20)
    names, dtypes, shapes = bucket.meta()
    assert names == ["d.fp64", "b.fp32", "a.bf16", "c.int8"]
    offset, flat = 0, bucket.flatten()
    for name, dtype, shape in zip(names, dtypes, shapes):
        size = torch.empty(shape, dtype=getattr(torch, dtype)).nbytes
        assert offset % getattr(torch, dtype).itemsize == 0, name
        view = flat[offset:offset + size].view(getattr(torch, dtype)).reshape(shape)   # the receiver's view
        assert torch.equal(view, dict(named)[name]), name
        offset += size
    assert offset == flat.numel() == bucket.nbytes


def test_non_expert_first_keeps_relative_order():
    names = [n for n, _ in non_expert_first(_named(), max_held_bytes=1 << 30)]
    assert names == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight",
                     "model.norm.weight", "model.layers.0.mlp.experts.3.up_proj.weight",
                     "model.layers.1.mlp.experts.0.down_proj.weight"]


def test_non_expert_first_holds_bounded_bytes():
    """An export that interleaves layers (attention, then 8 experts of 4 KiB, per layer): the reorder
    never holds more than its bound beyond the tensor in hand, and every tensor comes out once."""
    def export(layers=6):
        for layer in range(layers):
            yield f"model.layers.{layer}.self_attn.o_proj.weight", torch.zeros(32, 32)
            for j in range(8):
                yield f"model.layers.{layer}.mlp.experts.{j}.down_proj.weight", torch.zeros(32, 32)

    produced, consumed, peak = [0], [0], [0]

    def counted():
        for name, t in export():
            produced[0] += t.nbytes
            yield name, t

    out = []
    for name, t in non_expert_first(counted(), max_held_bytes=3 * 4096):
        peak[0] = max(peak[0], produced[0] - consumed[0])
        consumed[0] += t.nbytes
        out.append(name)
    assert sorted(out) == sorted(n for n, _ in export()) and len(out) == 6 * 9
    assert peak[0] <= 3 * 4096 + 4096           # the bound plus the tensor that overflowed it
    assert out[:4] == ["model.layers.0.self_attn.o_proj.weight"] + [
        f"model.layers.0.mlp.experts.{j}.down_proj.weight" for j in range(3)]   # held experts leave in runs of 3


def test_broadcast_delivers_bit_exact_to_every_engine_and_sets_version():
    async def scenario(engines):
        sync = build_weight_sync(WeightSyncConfig(bucket_mb=0.02, timeout_s=60), engines)
        assert isinstance(sync, BroadcastWeightSync)
        async with sync.update_session():
            await sync.push(_named(), version=3)
        second = [(n, t + 1) for n, t in _named()]
        async with sync.update_session():
            await sync.push(second, version=4)   # the group is reused
        checked = await check_weight_update_equal(engines, second)
        versions = [await e.weight_version() for e in engines]
        q = await engines[0].get_weights_by_name("model.layers.0.self_attn.q_proj.weight")
        await sync.close()
        return checked, sync.bytes_sent, versions, q.dtype

    engines = [FakeEngine("e0"), FakeEngine("e1")]
    checked, sent, versions, q_dtype = asyncio.run(run_then_close(engines, scenario))
    assert [(c.compared, c.layout) for c in checked] == [(6, "hf")] * 2
    assert sent == 2 * sum(t.numel() * t.element_size() for _, t in _named())
    assert versions == [4, 4] and q_dtype == torch.bfloat16 and [e.rank for e in engines] == [1, 2]
    for e in engines:   # one push: ONE session, liveness without generating; pausing is the driver's alone
        assert e.calls[:8] == ["begin_weight_update", "model_info", "init_weights_update_group"] + [
                               "update_weights_from_distributed"] * 4 + ["end_weight_update"]
        assert e.calls.count("begin_weight_update") == e.calls.count("end_weight_update") == 2
        assert "health" not in e.calls and "flush_cache" not in e.calls and not e.session_open


def test_dead_engine_is_named():
    async def scenario(engines):
        await BroadcastWeightSync(WeightSyncConfig(timeout_s=5), engines).push(_named(), version=1)

    with pytest.raises(EngineError, match=r"engine killed-7: liveness check \(/model_info\) failed"):
        asyncio.run(run_then_close([FakeEngine("alive"), FakeEngine("killed-7", dead=True)], scenario))


def test_push_never_calls_health():
    """SGLang's /health generates a token and, while paused, waits and answers 503: a push (here with
    the caller holding the pause, as the trainer does) must not depend on it."""
    class PausedHealth(FakeEngine):
        async def health(self) -> bool:
            self._note("health")
            return False

    async def scenario(engines):
        sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=0.05, timeout_s=60), engines)
        async with sync.update_session():
            await sync.push(_named(), version=2)
        await sync.close()
        return [await e.weight_version() for e in engines], engines[0].calls

    versions, calls = asyncio.run(run_then_close([PausedHealth("paused")], scenario))
    assert versions == [2] and "health" not in calls


def test_hung_engine_times_out_naming_it():
    async def scenario(engines):
        sync = BroadcastWeightSync(WeightSyncConfig(timeout_s=60), engines)
        await sync.connect()          # the fakes' process start is slow on 2 cores; time only the transfer
        sync.cfg.timeout_s = 3
        async with sync.update_session():
            await sync.push(_named(), version=1)

    with pytest.raises(EngineError, match=r"engine stuck.*: weights bucket 0 .* did not finish within 3s"):
        asyncio.run(run_then_close([FakeEngine("ok"), FakeEngine("stuck", hang=True)], scenario))


def test_check_equal_names_the_differing_tensor():
    async def main():
        engine = FakeEngine("e0")
        try:
            for name, tensor in _named():
                await engine.set_weight(name, tensor)
            bad = dict(_named())["model.norm.weight"].clone()
            bad[5] += 1e-3
            await engine.set_weight("model.norm.weight", bad)
            await check_weight_update_equal([engine], _named())
        finally:
            await engine.close()

    with pytest.raises(WeightMismatchError, match=r"engine e0 \(tp_rank 0 of 1\): model.norm.weight differs"):
        asyncio.run(main())


def test_disk_sync_writes_shards_and_keeps_latest(tmp_path):
    """No session (SGLang's disk load needs none) and flush_cache=False: SGLang would refuse the flush
    while requests paused in place hold KV; the window settles the cache instead."""
    class Recording(FakeEngine):
        flushes: list = []

        async def update_weights_from_disk(self, model_path, weight_version, flush_cache=True):
            Recording.flushes.append(flush_cache)
            await super().update_weights_from_disk(model_path, weight_version, flush_cache)

    async def scenario(engines):
        sync = build_weight_sync(WeightSyncConfig(method="disk", timeout_s=60), engines, run_dir=tmp_path)
        assert isinstance(sync, DiskWeightSync)
        await sync.push(_named(), version=1)
        await sync.push([(n, t * 2) for n, t in _named()], version=2)
        await check_weight_update_equal(engines, [(n, t * 2) for n, t in _named()])
        return await engines[0].weight_version(), engines[0].calls

    version, calls = asyncio.run(run_then_close([Recording("e0")], scenario))
    assert version == 2 and Recording.flushes == [False, False]
    assert "begin_weight_update" not in calls and "flush_cache" not in calls   # in place: never flushed
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2"]


def test_unknown_method_no_engines_and_nccl_without_gpu_refused():
    with pytest.raises(ValueError, match="no engines"):
        build_weight_sync(WeightSyncConfig(), [])
    with pytest.raises(ValueError, match="method 'ftp'"):
        build_weight_sync(WeightSyncConfig(method="ftp"), [object()])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="weight_sync.backend = 'nccl' needs CUDA"):
            build_weight_sync(WeightSyncConfig(backend="nccl"), [object()])


def test_sender_address_is_loopback_for_local_engines_and_routable_otherwise(monkeypatch):
    from types import SimpleNamespace

    from rollout.weights.base import sender_address
    from rollout.weights.calls import run_all

    monkeypatch.delenv("SAO_WEIGHT_SYNC_ADDR", raising=False)
    local = [SimpleNamespace(url="http://127.0.0.1:30000"), SimpleNamespace(url="http://localhost:30001")]
    assert sender_address(local) == "127.0.0.1"
    remote = sender_address([SimpleNamespace(url="http://10.1.2.3:30000")])
    assert remote.count(".") == 3        # the IPv4 address of the interface that routes there
    monkeypatch.setenv("SAO_WEIGHT_SYNC_ADDR", "192.0.2.7")
    assert sender_address(local) == "192.0.2.7"
    assert asyncio.run(run_all({}, "nothing", 1.0)) == []    # a rank with no engines has nothing to await


def test_push_never_pauses_resumes_or_settles(tmp_path):
    """One owner of pause/resume (the driver's window): a push against an engine that plays both roles
    only checks liveness and loads the weights; it never pauses, resumes, flushes or moves the namespace."""
    from rollout.engines.scripted import ScriptedEngine

    engine = ScriptedEngine("both-roles")
    sync = build_weight_sync(WeightSyncConfig(method="disk", timeout_s=60), [engine], run_dir=tmp_path)
    asyncio.run(sync.push(_named(), version=2))
    assert engine.calls == ["update_weights_from_disk"] and engine.version == 2
    assert engine.paused_mode is None and engine.cache_namespace is None
