"""Weight sync against the reference rollout server (a real process, HTTP + gloo):
- after a broadcast, /get_weights_by_name equals the trainer tensors bit for bit, for all 135 tensors;
- the server's logprobs then equal the trainer's on the same tokens (mean |delta| < 1e-5, fp32);
- a sync to a killed server fails within the timeout naming the engine.
The trainer side here is the HF model with the new weights; the Megatron trainer's own check lives in
tests/distributed/test_convert_megatron.py.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from checkpoints.hf_io import HFCheckpoint
from rollout.engines.engine import EngineError, GenerateRequest
from rollout.weights.check import check_weight_update_equal
from rollout.weights import BroadcastWeightSync, DiskWeightSync
from sao_megatron.core.config import WeightSyncConfig


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from rollout.engines.reference_server import launch_local

    srv = launch_local(tiny_model_dir, port=0, api_key="k", timeout_s=300)
    yield srv
    srv.stop()


def _new_weights(model_dir, scale: float):
    """The 'trained' weights: every tensor perturbed deterministically."""
    g = torch.Generator().manual_seed(7)
    return [(n, t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype)) for n, t in HFCheckpoint(model_dir).items()]


def _engine(srv, name="ref-0"):
    from rollout.engines.sglang_client import SGLangEngine

    return SGLangEngine(srv.url, api_key="k", name=name, control_timeout_s=30, weight_timeout_s=120)


def _hf_logprobs(model_dir, named, prompt: list[int], output: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    from rollout.engines.reference_server.weights import WeightMap

    wm = WeightMap(model)
    with torch.no_grad():
        for n, t in named:
            wm.load(n, t)
        ids = torch.tensor([prompt + output])
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return logp[len(prompt) - 1: -1].gather(1, torch.tensor(output)[:, None])[:, 0]


def test_broadcast_then_weights_and_logprobs_match_trainer(server, tiny_model_dir):
    named = _new_weights(tiny_model_dir, 0.05)
    prompt = [5, 17, 33, 40, 41, 42]

    async def scenario():
        engine = _engine(server)
        try:
            sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=0.05, timeout_s=120), [engine])
            async with sync.update_session():   # the caller holds the session (and any pause)
                await sync.push(named, version=5)
            checked = await check_weight_update_equal([engine], named)
            version = await engine.weight_version()
            result = await engine.generate(GenerateRequest(rid="lp-1", input_ids=prompt, max_new_tokens=8,
                                                           temperature=1.0, seed=3, return_routed_experts=False))
            await sync.close()
            return checked, version, result
        finally:
            await engine.close()

    checked, version, result = asyncio.run(scenario())
    # 135 HF tensors, 47 on the server (experts fused as transformers 5 holds them), all compared
    assert len(named) == 135 and [(c.compared, c.layout) for c in checked] == [(47, "hf")] and version == 5
    trainer = _hf_logprobs(tiny_model_dir, named, prompt, result.output_ids)
    served = torch.tensor(result.output_logprobs)
    assert len(result.output_ids) == 8 and (served - trainer).abs().mean().item() < 1e-5


def test_disk_sync_to_reference_server(server, tiny_model_dir, tmp_path):
    named = _new_weights(tiny_model_dir, 0.01)

    async def scenario():
        engine = _engine(server)
        try:
            await DiskWeightSync(WeightSyncConfig(method="disk", timeout_s=120), [engine], tmp_path).push(named, version=9)
            checked = await check_weight_update_equal([engine], named)
            return [c.compared for c in checked], await engine.weight_version()
        finally:
            await engine.close()

    assert asyncio.run(scenario()) == ([47], 9)


def test_sync_to_killed_server_names_it(tiny_model_dir):
    from rollout.engines.reference_server import launch_local

    srv = launch_local(tiny_model_dir, port=0, api_key="k", timeout_s=300)
    srv.process.kill()
    srv.process.wait(30)

    async def scenario():
        engine = _engine(srv, name="killed-engine")
        try:
            await BroadcastWeightSync(WeightSyncConfig(timeout_s=20), [engine]).push(_new_weights(tiny_model_dir, 0.0), 1)
        finally:
            await engine.close()

    with pytest.raises(EngineError, match="killed-engine"):
        asyncio.run(scenario())


def test_server_dying_mid_sync_is_named(tiny_model_dir):
    """The server is killed between bucket 2 and bucket 3 of a push: the push fails with the engine's
    name (its next update call is refused), the sender's blocked broadcast does not hold it up."""
    from rollout.engines.reference_server import launch_local
    from rollout.engines.sglang_client import SGLangEngine

    srv = launch_local(tiny_model_dir, port=0, api_key="k", timeout_s=300)

    class DyingEngine(SGLangEngine):
        calls = 0

        async def update_weights_from_distributed(self, *args, **kwargs):
            DyingEngine.calls += 1
            if DyingEngine.calls == 3:
                srv.process.kill()
                srv.process.wait(30)
            await super().update_weights_from_distributed(*args, **kwargs)

    async def scenario():
        engine = DyingEngine(srv.url, api_key="k", name="dying-engine", control_timeout_s=30, weight_timeout_s=60)
        try:
            sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=0.05, timeout_s=60), [engine])
            async with sync.update_session():
                await sync.push(_new_weights(tiny_model_dir, 0.0), 1)
        finally:
            await engine.close()

    try:
        with pytest.raises(EngineError, match=r"engine dying-engine.*weights bucket 2"):
            asyncio.run(scenario())
    finally:
        srv.stop()
    assert DyingEngine.calls == 3


def test_engines_of_different_tp_each_join_with_their_ranks(tiny_model_dir):
    """Two reference servers, `--tp 2` and `--tp 1`: the group has 1 + 2 + 1 members, engine 0 joins as
    ranks 1-2 and engine 1 as rank 3 (SGLang: rank_offset + tp_rank), and both hold the new weights.
    A sync that counts the tp-2 server as one rank is refused by it, naming the engine."""
    from rollout.engines.reference_server import launch_local

    servers = [launch_local(tiny_model_dir, port=0, api_key="k", timeout_s=300, extra_args=["--tp", "2"]),
               launch_local(tiny_model_dir, port=0, api_key="k", timeout_s=300)]
    named = _new_weights(tiny_model_dir, 0.02)

    async def scenario():
        engines = [_engine(s, name=f"tp{tp}") for s, tp in zip(servers, (2, 1))]
        try:
            sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=0.5, timeout_s=120), engines, ranks_per_engine=[2, 1])
            async with sync.update_session():
                await sync.push(named, version=6)
            checked = await check_weight_update_equal(engines, named)
            await sync.close()
            wrong = BroadcastWeightSync(WeightSyncConfig(timeout_s=60), engines[:1], ranks_per_engine=1)
            with pytest.raises(EngineError, match=r"engine tp2: joining weight-update group .* with --tp 2 needs"):
                await wrong.connect()
            return sync.rank_offsets(), sync.world_size, checked, [await e.weight_version() for e in engines]
        finally:
            for e in engines:
                await e.close()

    try:
        offsets, world, checked, versions = asyncio.run(scenario())
    finally:
        for s in servers:
            s.stop()
    assert offsets == [1, 3] and world == 4 and versions == [6, 6]
    assert [c.compared for c in checked] == [47, 47]
