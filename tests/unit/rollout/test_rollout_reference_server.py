"""RolloutDriver against real reference servers over HTTP (the SGLang protocol).

Two servers per module; tests that change weight versions read the starting version first, and the
killed-engine test launches its own third server to kill.
"""
from __future__ import annotations

import asyncio

import pytest

from checkpoints.init_model import build_tokenizer
from rollout.driver import RolloutDriver
from rollout.prompts import build_prompt_source
from rollout.engines.reference_server import launch_local
from rollout.rewards import resolve_reward_fn
from rollout.engines.sglang_client import SGLangEngine
from sao_megatron.core.config.schema import RolloutConfig
from sao_megatron.core.records import SampleStatus

KEY = "drv-key"
TOK = build_tokenizer()


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    handles = [launch_local(tiny_model_dir, api_key=KEY, timeout_s=300, seed=i) for i in range(2)]
    yield handles
    for h in handles:
        h.stop()


def cfg(**kw):
    base = dict(task="arithmetic", batch_size=4, max_in_flight=6, max_new_tokens=12, staleness_bound=100,
                request_timeout_s=120.0, reward_timeout_s=10.0)
    base.update(kw)
    return RolloutConfig(**base)


def run_driver(handles, config, scenario, **kw):
    async def main():
        engines = [SGLangEngine(h.url, api_key=KEY, name=f"ref{i}", timeout_s=120, max_retries=0, moe_topk=2)
                   for i, h in enumerate(handles)]
        source = build_prompt_source(config, TOK, seed=0, num_problems=64)
        driver = RolloutDriver(engines, source, resolve_reward_fn(config), config, TOK, seed=0,
                               probe_interval_s=0.2, **kw)
        await driver.start()
        try:
            return await scenario(driver, engines)
        finally:
            await driver.stop()
            for e in engines:
                await e.close()
    return asyncio.run(main())


def assert_no_loss_no_dup(driver, returned):
    state = driver.state_dict()
    held = [d["uid"] for g in state["buffer"]["ready"] for d in g] + [d["uid"] for d in state["buffer"]["partial"]]
    uids = [s.uid for s in returned] + held + [d["uid"] for d in state["work"]]
    assert len(uids) == len(set(uids))
    assert sorted({int(u[1:].split("-")[0]) for u in uids}) == list(range(state["prompt_source"]["drawn"]))


def test_single_mode_one_sample_per_prompt(servers):
    async def scenario(driver, engines):
        v0 = await engines[0].weight_version()
        out = await driver.get_batch(4, v0) + await driver.get_batch(4, v0)
        assert_no_loss_no_dup(driver, out)
        return out, v0

    out, v0 = run_driver(servers, cfg(), scenario)
    assert len({s.prompt_index for s in out}) == 8
    for s in out:
        s.check()
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and 0.0 <= s.reward <= 1.0
        assert set(s.weight_versions) == {v0} and all(lp <= 0.0 for lp in s.rollout_logprobs)
        assert s.routed_experts is not None and tuple(s.routed_experts.shape) == (s.num_tokens - 1, 4, 2)
    assert {s.metadata["engine"] for s in out} == {"ref0", "ref1"}


def test_group_mode_n_samples_per_prompt(servers):
    async def scenario(driver, engines):
        v0 = await engines[0].weight_version()
        return await driver.get_batch(8, v0)

    batch = run_driver(servers, cfg(mode="group", n_samples_per_prompt=4, batch_size=8), scenario)
    groups = {}
    for s in batch:
        groups.setdefault(s.group_id, []).append(s.uid)
    assert len(groups) == 2 and all(sorted(u) == [f"p{g}-{k}" for k in range(4)] for g, u in groups.items())


def test_killed_engine_mid_run_loses_and_duplicates_nothing(servers, tiny_model_dir):
    victim = launch_local(tiny_model_dir, api_key=KEY, timeout_s=300, seed=7)
    try:
        async def scenario(driver, engines):
            v0 = await engines[0].weight_version()
            out = await driver.get_batch(4, v0)
            victim.process.kill()
            for _ in range(3):
                out += await driver.get_batch(4, v0)
            assert_no_loss_no_dup(driver, out)
            return out, driver.counts["engine_errors"]

        out, errors = run_driver([servers[0], victim], cfg(max_new_tokens=24), scenario)
    finally:
        victim.stop()
    assert len({s.uid for s in out}) == 16 and all(s.status != SampleStatus.FAILED for s in out)
    assert errors >= 1 and all(s.metadata["engine"] == "ref0" for s in out[8:])


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_per_token_versions_across_an_update(servers, tiny_model_dir, mode):
    async def scenario(driver, engines):
        v0 = await engines[0].weight_version()
        await asyncio.sleep(0.3)                          # requests are mid-generation
        async with driver.weight_update(mode, v0 + 1):
            in_flight = {d["uid"] for d in driver.state_dict()["work"]}
            for e in engines:
                # same weights, new version; an in-place pause keeps requests in the batch: no flush (SGLang)
                await e.update_weights_from_disk(str(tiny_model_dir), v0 + 1, flush_cache=mode != "in_place")
        # samples that finished before the pause come first; read on until every sample that was in
        # flight at the pause is back (how many finished before depends on the machine's speed)
        batch = []
        for _ in range(10):
            batch += await driver.get_batch(6, v0 + 1)
            if in_flight <= {s.uid for s in batch}:
                break
        return [s for s in batch if s.uid in in_flight], v0, driver.counts["continuations"]

    batch, v0, continuations = run_driver(servers, cfg(max_new_tokens=64, max_in_flight=6, batch_size=6), scenario)
    spanning = 0
    for s in batch:
        s.check()
        assert s.weight_versions == sorted(s.weight_versions) and set(s.weight_versions) <= {v0, v0 + 1}
        spanning += len(set(s.weight_versions)) == 2
    assert spanning >= 1
    if mode == "retract":
        assert continuations >= 1


def test_staleness_bound_holds_with_fast_trainer(servers, tiny_model_dir):
    async def scenario(driver, engines):
        version = await engines[0].weight_version()
        worst = 0
        for _ in range(4):
            batch = await driver.get_batch(2, version)
            worst = max(worst, max(s.staleness(version) for s in batch))
            version += 1
            async with driver.weight_update("in_place", version):
                for e in engines:
                    await e.update_weights_from_disk(str(tiny_model_dir), version, flush_cache=False)
        return worst, driver.metrics()

    worst, metrics = run_driver(servers, cfg(staleness_bound=1, max_in_flight=8, batch_size=2, max_new_tokens=32),
                                scenario)
    assert worst <= 1 and metrics["rollout/staleness_max"] <= 1
