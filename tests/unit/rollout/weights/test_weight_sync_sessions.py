"""The weight-update sessions of BroadcastWeightSync against LoopbackEngine fakes that answer as SGLang
0.5.23 does (update_weights_from_distributed refused outside a begin/end_weight_update session):
sessions per push and per engine, a refusal failing fast, a stale session recovered, rank offsets for
engines of different TP, the payload device. The pause, the prefix-cache settle per pause mode and
the resume are the rollout driver's (test_weight_sync_window.py)."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rollout.engines.engine import EngineError
from rollout.weights import broadcast as weight_sync, calls as engine_calls
from rollout.weights import BroadcastWeightSync
from sao_megatron.core.config import WeightSyncConfig

from weight_sync_fakes import FakeEngine, run_then_close


def _named():
    g = torch.Generator().manual_seed(1)
    return [("model.layers.0.self_attn.o_proj.weight", torch.randn(64, 64, generator=g)),
            ("model.layers.0.mlp.experts.0.down_proj.weight", torch.randn(64, 64, generator=g)),
            ("model.norm.weight", torch.randn(64, generator=g).to(torch.bfloat16))]


def test_two_stage_senders_share_one_session_per_engine():
    """pp=2 with per-stage senders: two syncs (two named groups) push to the same engines inside ONE
    session the owner opened, one stage after the other, as the trainer does around all stages."""
    stage0, stage1 = _named()[:2], _named()[2:]

    async def scenario(engines):
        cfg = WeightSyncConfig(bucket_mb=0.01, timeout_s=60)
        senders = [BroadcastWeightSync(cfg, engines, stage=s) for s in (0, 1)]
        for sender in senders:
            await sender.connect()
        async with senders[0].update_session():
            await senders[0].push(stage0, 3)
            await senders[1].push(stage1, 3)
        got = [await e.get_weights_by_name(n) for e in engines for n, _ in stage0 + stage1]
        for sender in senders:
            await sender.close()
        return got, [e.calls for e in engines]

    engines = [FakeEngine("e0"), FakeEngine("e1")]
    got, calls = asyncio.run(run_then_close(engines, scenario))
    assert all(torch.equal(g, t) for g, (_, t) in zip(got, (stage0 + stage1) * 2))
    for c in calls:
        assert c.count("begin_weight_update") == c.count("end_weight_update") == 1
        updates = [i for i, x in enumerate(c) if x == "update_weights_from_distributed"]
        assert len(updates) == 3 and c.index("begin_weight_update") < updates[0] < updates[-1] < \
            c.index("end_weight_update")


def test_refused_update_fails_at_once_naming_the_engine_and_closes_sessions():
    """An engine that refuses the bucket (HTTP 400, no session) fails the push with its name at once,
    not at the group timeout, although the sender's broadcast is still blocked on it; the sessions
    opened for the push are closed again."""
    class Refusing(FakeEngine):
        async def update_weights_from_distributed(self, *args, **kwargs):
            self.session_open = False    # as if the engine restarted: SGLang answers 400 at once
            await super().update_weights_from_distributed(*args, **kwargs)

    async def scenario(engines):
        sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=1, timeout_s=60), engines)
        await sync.connect()
        sync.cfg.timeout_s = 3600      # a timeout would mean the refusal was not seen
        async with sync.update_session():
            await sync.push(_named(), version=1)

    engines = [FakeEngine("fine"), Refusing("refusing")]
    with pytest.raises(EngineError, match=r"engine refusing: weights bucket 0 .* failed: .*begin_weight_update\(\) "
                                          r"and end_weight_update\(\)") as info:
        asyncio.run(run_then_close(engines, scenario))
    assert "did not finish" not in str(info.value)
    assert not engines[0].session_open and engines[0].calls.count("end_weight_update") == 1
    assert engines[0].calls[-1] == "end_weight_update"       # closed last: resuming is the driver's


def test_a_session_left_open_by_a_failed_push_is_recovered():
    async def scenario(engines):
        await engines[0].begin_weight_update()      # a crashed trainer's session, never closed
        sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=1, timeout_s=60), engines)
        async with sync.update_session():
            await sync.push(_named(), version=7)
        await sync.close()
        return await engines[0].weight_version(), engines[0].calls

    version, calls = asyncio.run(run_then_close([FakeEngine("e0")], scenario))
    assert version == 7
    assert calls[:4] == ["begin_weight_update", "begin_weight_update", "end_weight_update",
                         "begin_weight_update"] and calls[4] == "model_info"


def test_rank_offsets_tile_engines_of_different_tp():
    engines = [object(), object(), object()]
    sync = BroadcastWeightSync(WeightSyncConfig(), engines, ranks_per_engine=[2, 1, 4], master_address="127.0.0.1")
    assert sync.rank_offsets() == [1, 3, 4] and sync.world_size == 8
    same = BroadcastWeightSync(WeightSyncConfig(), engines, ranks_per_engine=2, master_address="127.0.0.1")
    assert same.rank_offsets() == [1, 3, 5] and same.world_size == 7
    with pytest.raises(ValueError, match="ranks_per_engine .* one per engine"):
        BroadcastWeightSync(WeightSyncConfig(), engines, ranks_per_engine=[2, 1], master_address="127.0.0.1")


def test_payload_device_is_the_calling_threads_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert engine_calls.payload_device("nccl") == torch.device("cuda", 3)
    assert engine_calls.payload_device("gloo") == torch.device("cpu")


def test_flatten_and_broadcast_threads_are_pinned_to_the_captured_device(monkeypatch):
    """The device is captured once in the pushing thread and made current in the flatten thread and
    in the broadcast thread (a new thread starts on cuda:0)."""
    pins = []
    captured = torch.device("cpu")
    monkeypatch.setattr(weight_sync, "payload_device", lambda backend: captured)
    monkeypatch.setattr(engine_calls, "pin_thread", lambda device: pins.append((threading.current_thread().name,
                                                                                 device)))

    async def scenario(engines):   # one bucket of three tensors: flattened (a lone tensor would go in place)
        sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=0.05, timeout_s=60), engines)
        async with sync.update_session():
            await sync.push(_named(), version=1)
        await sync.close()

    asyncio.run(run_then_close([FakeEngine("e0")], scenario))
    main = threading.main_thread().name
    assert pins and all(device is captured or device == captured for _, device in pins)
    assert all(name != main for name, _ in pins)                    # only worker threads are pinned
    assert any(name.startswith("weight-sync-") for name, _ in pins)  # the broadcast thread
    assert any(not name.startswith("weight-sync-") for name, _ in pins)  # the flatten thread
