"""RolloutDriver against in-process fake engines: placement, groups, failover, staleness, versions, resume."""
from __future__ import annotations

import asyncio
import json

import pytest

from checkpoints.init_model import build_tokenizer
from rollout.driver import DriverError, RolloutDriver
from rollout.prompts import build_prompt_source
from rollout.rewards import resolve_reward_fn
from rollout.engines.scripted import ScriptedEngine as FakeEngine
from sao_megatron.core.config.schema import RolloutConfig
from sao_megatron.core.records import SampleStatus

from context_engine import ContextEngine

TOK = build_tokenizer()


def make_cfg(**kw) -> RolloutConfig:
    base = dict(task="arithmetic", batch_size=8, max_in_flight=8, max_new_tokens=12, staleness_bound=100,
                request_timeout_s=30.0, reward_timeout_s=5.0)
    base.update(kw)
    return RolloutConfig(**base)


def make_driver(engines, cfg, **kw):
    source = build_prompt_source(cfg, TOK, seed=0, num_problems=64)
    kw.setdefault("reward_fn", resolve_reward_fn(cfg))
    return RolloutDriver(engines, source, kw.pop("reward_fn"), cfg, TOK, seed=0, probe_interval_s=0.01, **kw)


def engines(n, **kw):
    kw.setdefault("token_time_s", 0.0005)
    return [FakeEngine(f"e{i}", seed=i, **kw) for i in range(n)]


def version_echo(engine):
    """Tokens spell the engine's weight version ('0' + v), so a token's true version is readable."""
    engine.responder = lambda ids, step: 7 + engine.version
    return engine


def check_no_loss_no_dup(driver, returned, earlier=()):
    """Every drawn prompt is exactly once in: returned batches, the buffer, or in-flight/pending work."""
    returned = list(earlier) + list(returned)
    state = driver.state_dict()
    held = [d["uid"] for g in state["buffer"]["ready"] for d in g] + [d["uid"] for d in state["buffer"]["partial"]]
    held += [d["uid"] for d in state["work"]]
    uids = [s.uid for s in returned] + held
    assert len(uids) == len(set(uids))
    drawn = state["prompt_source"]["drawn"]
    assert sorted({int(u[1:].split("-")[0]) for u in uids}) == list(range(drawn))


def test_single_mode_one_sample_per_prompt_with_consistent_tokens():
    cfg = make_cfg()
    eng = engines(3)

    async def main():
        d = make_driver(eng, cfg)
        await d.start()
        out = []
        for _ in range(5):
            out += await d.get_batch(8, current_version=0)
        check_no_loss_no_dup(d, out)
        metrics = d.metrics()
        await d.stop()
        return out, metrics

    out, metrics = asyncio.run(main())
    assert len(out) == 40 and len({s.prompt_index for s in out}) == 40
    for s in out:
        s.check()
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        assert 0.0 <= s.reward <= 1.0 and set(s.loss_mask) == {1} and set(s.weight_versions) == {0}
        assert s.rollout_logprobs == [-1.0] * len(s.response_ids)
    assert all(len(e.rids) > 0 for e in eng)      # least-loaded placement spreads the work
    assert metrics["rollout/staleness_max"] == 0 and metrics["rollout/failed"] == 0
    for key in ("rollout/raw_reward", "rollout/response_len", "rollout/staleness", "rollout/dropped_stale",
                "rollout/samples_per_s", "rollout/in_flight"):
        assert key in metrics


def test_group_mode_returns_whole_groups_of_n():
    cfg = make_cfg(mode="group", n_samples_per_prompt=4, batch_size=8)

    async def main():
        d = make_driver(engines(2), cfg)
        await d.start()
        batches = [await d.get_batch(8, 0) for _ in range(3)]
        await d.stop()
        return batches

    for batch in asyncio.run(main()):
        groups = {}
        for s in batch:
            groups.setdefault(s.group_id, []).append(s)
        assert len(groups) == 2
        for gid, members in groups.items():
            assert sorted(s.uid for s in members) == [f"p{gid}-{k}" for k in range(4)]
            assert {s.prompt_index for s in members} == {gid}


def test_killed_engine_loses_and_duplicates_nothing():
    cfg = make_cfg(max_in_flight=12)
    eng = engines(3, token_time_s=0.002)

    async def main():
        d = make_driver(eng, cfg)
        await d.start()
        out = await d.get_batch(8, 0)
        eng[1].kill()
        for _ in range(5):
            out += await d.get_batch(8, 0)
        check_no_loss_no_dup(d, out)
        errors = d.counts["engine_errors"]
        await d.stop()
        return out, errors

    out, errors = asyncio.run(main())
    assert errors >= 1
    assert len({s.uid for s in out}) == len(out) == 48
    assert all(s.status != SampleStatus.FAILED for s in out)


def test_dead_engine_comes_back_after_health_probe():
    cfg = make_cfg()
    eng = engines(2)

    async def main():
        d = make_driver(eng, cfg)
        await d.start()
        eng[0].kill()
        await d.get_batch(8, 0)
        eng[0].revive()
        before = len(eng[0].rids)
        await d.get_batch(16, 0)
        await d.stop()
        return len(eng[0].rids) - before

    assert asyncio.run(main()) > 0


def test_all_engines_down_fails_with_a_clear_error():
    cfg = make_cfg()
    eng = engines(2)
    for e in eng:
        e.kill()

    async def main():
        d = make_driver(eng, cfg, stall_timeout_s=0.3)
        d._versions = {e.name: 0 for e in eng}
        # start() asks each engine for its version: a dead engine is named at once
        with pytest.raises(DriverError, match="engine e0"):
            await d.start()

    asyncio.run(main())


def test_engines_dying_mid_run_fail_get_batch_instead_of_hanging():
    cfg = make_cfg()
    eng = engines(2)

    async def main():
        d = make_driver(eng, cfg, stall_timeout_s=0.3)
        await d.start()
        for e in eng:
            e.kill()
        with pytest.raises(DriverError, match="all engines are down"):
            await d.get_batch(8, 0)
        await d.stop()

    asyncio.run(main())


def test_staleness_bound_holds_under_fast_trainer_slow_engine():
    cfg = make_cfg(staleness_bound=1, stale_policy="drop", max_in_flight=16)
    eng = [version_echo(e) for e in engines(2, token_time_s=0.003)]

    async def main():
        d = make_driver(eng, cfg)
        await d.start()
        out, version = [], 0
        for _ in range(6):
            batch = await d.get_batch(4, version)
            assert max(s.staleness(version) for s in batch) <= 1
            out += batch
            version += 1
            async with d.weight_update("in_place", version):
                for e in eng:
                    await e.update_weights_from_disk("unused", version)
        check_no_loss_no_dup_after_drops(d, out)
        m = d.metrics()
        await d.stop()
        return m

    m = asyncio.run(main())
    assert m["rollout/dropped_stale"] > 0 and m["rollout/staleness_max"] <= 1


def check_no_loss_no_dup_after_drops(d, out):
    """Drop policy: every drawn prompt is returned, held, or counted as dropped - exactly once."""
    state = d.state_dict()
    held = [x["uid"] for g in state["buffer"]["ready"] for x in g] + [x["uid"] for x in state["work"]]
    uids = [s.uid for s in out] + held
    assert len(uids) == len(set(uids))
    assert len(uids) + d.stats.dropped == state["prompt_source"]["drawn"]


def test_stale_samples_are_regenerated_not_lost():
    cfg = make_cfg(staleness_bound=0, stale_policy="regenerate", max_in_flight=8)
    eng = engines(2, token_time_s=0.002)

    async def main():
        d = make_driver(eng, cfg)
        await d.start()
        out = await d.get_batch(4, 0)
        await asyncio.sleep(0.1)                       # let samples finish at version 0
        async with d.weight_update("in_place", 1):
            for e in eng:
                e.version = 1
        out += await d.get_batch(4, 1)
        out += await d.get_batch(4, 1)
        check_no_loss_no_dup(d, out)
        dropped = d.stats.dropped
        await d.stop()
        return out, dropped

    out, dropped = asyncio.run(main())
    assert dropped > 0
    assert all(s.staleness(1) == 0 for s in out[4:])


@pytest.mark.parametrize("report", [True, False])
def test_in_place_update_versions_per_token(report):
    cfg = make_cfg(max_new_tokens=40, max_in_flight=4, batch_size=4)
    eng = [version_echo(FakeEngine("e0", token_time_s=0.002, report_versions=report,
                                   length_fn=lambda rng: 40))]

    async def main():
        d = make_driver(eng, cfg)
        await d.start()
        await asyncio.sleep(0.03)                      # requests are mid-generation
        async with d.weight_update("in_place", 1):
            eng[0].version = 1
        batch = await d.get_batch(4, 1)
        await d.stop()
        return batch

    spanning = 0
    for s in asyncio.run(main()):
        true = [t - 7 for t in s.response_ids[:-1]]      # last token is EOS
        if report:
            assert s.weight_versions[:-1] == true        # exact per token
        else:
            assert all(v <= t for v, t in zip(s.weight_versions, true))  # never younger than truth
        spanning += len(set(true)) == 2
    assert spanning >= 1


@pytest.mark.parametrize("mode", ["retract", "abort"])
def test_retract_and_abort_resume_partials_with_exact_versions(mode):
    cfg = make_cfg(max_new_tokens=40, max_in_flight=4, batch_size=4)
    eng = [version_echo(FakeEngine("e0", token_time_s=0.002, report_versions=False, length_fn=lambda rng: 30))]

    async def main():
        d = make_driver(eng, cfg)
        await d.start()
        await asyncio.sleep(0.03)
        async with d.weight_update(mode, 1):
            eng[0].version = 1
        batch = await d.get_batch(4, 1)
        continuations = d.counts["continuations"]
        await d.stop()
        return batch, continuations

    batch, continuations = asyncio.run(main())
    assert continuations >= 1
    spanning = 0
    for s in batch:
        s.check()
        eos = [i for i, t in enumerate(s.response_ids) if t == 2]
        assert len(s.response_ids) <= 40                 # the continuation respects the total budget
        assert eos == [len(s.response_ids) - 1] or (s.status == SampleStatus.TRUNCATED and not eos)
        true = [t - 7 if t != 2 else v for t, v in zip(s.response_ids, s.weight_versions)]
        assert s.weight_versions == true                 # exact without engine reporting
        spanning += {0, 1} <= set(s.weight_versions)
    assert spanning >= 1


def test_reward_that_raises_or_times_out_fails_the_sample_and_the_run_goes_on():
    cfg = make_cfg(reward_timeout_s=0.05)

    async def flaky(sample):
        if sample.prompt_index % 3 == 0:
            raise KeyError("no answer")
        if sample.prompt_index % 3 == 1:
            await asyncio.sleep(10)
        return 0.5

    async def main():
        d = make_driver(engines(2), cfg, reward_fn=flaky)
        await d.start()
        batch = await d.get_batch(6, 0)
        batch += await d.get_batch(6, 0)
        failures = dict(d.recent_failures)
        await d.stop()
        return batch, failures

    batch, failures = asyncio.run(main())
    assert all(s.reward == 0.5 and s.prompt_index % 3 == 2 for s in batch)
    assert failures["p0"] == "reward raised KeyError: 'no answer'"
    assert failures["p1"] == "reward timed out after 0.05s (rollout.reward_timeout_s)"


def test_worker_crash_is_raised_by_get_batch():
    cfg = make_cfg()

    class BrokenAgent:
        async def rollout(self, sample, turn, tokenizer):
            raise ZeroDivisionError("bug in the agent")

    async def main():
        d = make_driver(engines(1), cfg, agent=BrokenAgent())
        await d.start()
        with pytest.raises(DriverError, match="ZeroDivisionError"):
            await d.get_batch(4, 0)
        await d.stop()

    asyncio.run(main())


def test_resume_from_state_dict_mid_flight_loses_and_duplicates_nothing():
    cfg = make_cfg(max_in_flight=10)

    async def first():
        d = make_driver(engines(2, token_time_s=0.002), cfg)
        await d.start()
        out = await d.get_batch(8, 0)
        await asyncio.sleep(0.01)
        state = json.loads(json.dumps(d.state_dict()))   # checkpoints store it as JSON
        assert state["work"]                             # some samples are in flight
        await d.stop()
        return out, state

    async def second(state, out1):
        d = make_driver(engines(2), cfg)
        d.load_state_dict(state)
        await d.start()
        out = []
        for _ in range(4):
            out += await d.get_batch(8, 0)
        check_no_loss_no_dup(d, out, earlier=out1)
        await d.stop()
        return out, d

    out1, state = asyncio.run(first())
    out2, d = asyncio.run(second(state, out1))
    uids = [s.uid for s in out1 + out2]
    assert len(uids) == len(set(uids))
    resumed = {d_["uid"] for d_ in state["work"]}
    assert resumed <= {s.uid for s in out2} | {x["uid"] for x in d.state_dict()["work"]} | \
        {x["uid"] for g in d.state_dict()["buffer"]["ready"] for x in g}


def test_routed_experts_cover_prompt_and_response_after_continuation():
    cfg = make_cfg(max_new_tokens=30, max_in_flight=2, batch_size=2)
    eng = [FakeEngine("e0", token_time_s=0.002, routed_layers=3, length_fn=lambda rng: 20)]

    async def main():
        d = make_driver(eng, cfg)
        await d.start()
        await asyncio.sleep(0.01)
        async with d.weight_update("abort", 1):
            eng[0].version = 1
        batch = await d.get_batch(2, 1)
        await d.stop()
        return batch

    for s in asyncio.run(main()):
        s.check()
        assert s.routed_experts is not None and s.routed_experts.shape == (s.num_tokens - 1, 3, 2)


def test_bad_update_mode_is_rejected():
    cfg = make_cfg()

    async def main():
        d = make_driver(engines(1), cfg)
        await d.start()
        with pytest.raises(ValueError, match="weight_update mode"):
            async with d.weight_update("sideways"):
                pass
        await d.stop()

    asyncio.run(main())


def test_token_budgeted_batches_fit_the_budget():
    cfg = make_cfg(max_new_tokens=20)

    async def main():
        d = make_driver(engines(2), cfg)
        await d.start()
        batches = [await d.get_batch(8, 0, max_tokens=200) for _ in range(3)]
        await d.stop()
        return batches

    for batch in asyncio.run(main()):
        tokens = sum(s.num_tokens for s in batch)
        assert batch and (tokens <= 200 or len(batch) == 1)


def test_online_environment_phase_follows_the_trainer_version():
    cfg = make_cfg(task="online", env_switch_every=2, max_new_tokens=4, batch_size=4)

    async def main():
        d = make_driver(engines(2), cfg, buffer_capacity=12)
        await d.start()
        seen = []
        for version in (0, 0, 2, 2, 2, 4, 4, 4):
            batch = await d.get_batch(4, version)
            seen += batch
            assert d.metrics()["env/phase"] == batch[-1].reward_info["env_phase"]
            assert all(s.metadata["env_step"] <= version for s in batch)
        await d.stop()
        return seen

    seen = asyncio.run(main())
    for s in seen:      # scored by the rule of the phase at the trainer step when it finished
        assert s.reward_info["env_phase"] == (s.metadata["env_step"] // 2) % 3
    assert {s.reward_info["env_phase"] for s in seen} == {0, 1, 2}


def test_group_mode_stale_groups_are_regenerated_whole():
    cfg = make_cfg(mode="group", n_samples_per_prompt=2, batch_size=4, staleness_bound=0, stale_policy="regenerate")
    eng = engines(2, token_time_s=0.002)

    async def main():
        d = make_driver(eng, cfg, staleness_admission=False)   # let groups go stale (buffer room only)
        await d.start()
        await d.get_batch(4, 0)
        await asyncio.sleep(0.1)                       # more groups finish at version 0
        async with d.weight_update("in_place", 1):
            for e in eng:
                e.version = 1
        batch = await d.get_batch(4, 1) + await d.get_batch(4, 1)
        dropped = d.stats.dropped
        await d.stop()
        return batch, dropped

    batch, dropped = asyncio.run(main())
    assert dropped > 0 and dropped % 2 == 0           # whole groups
    groups = {}
    for s in batch:
        groups.setdefault(s.group_id, []).append(s)
        assert set(s.weight_versions) == {1}
    assert all(len(g) == 2 for g in groups.values())


def test_dynamic_sampling_filter_drops_zero_variance_groups():
    from rollout.buffer import nonzero_reward_variance
    cfg = make_cfg(mode="group", n_samples_per_prompt=2, batch_size=4)

    def reward(sample):                                # prompts with an even index: both members equal
        return 1.0 if sample.prompt_index % 2 == 0 else float(sample.uid.endswith("-0"))

    async def main():
        d = make_driver(engines(2), cfg, reward_fn=reward, filters=[nonzero_reward_variance])
        await d.start()
        batch = await d.get_batch(4, 0)
        filtered = d.metrics()["rollout/dropped_filtered"]
        await d.stop()
        return batch, filtered

    batch, filtered = asyncio.run(main())
    assert all(s.prompt_index % 2 == 1 for s in batch) and filtered >= 4


def test_dead_engine_probe_waits_out_an_update_window():
    """/health generates (SGLang): probing a paused engine would wait and mark it unhealthy, so the
    probe skips while a weight update holds the engines paused."""
    cfg = make_cfg()
    eng = engines(2)
    probed = []

    async def main():
        d = make_driver(eng, cfg)
        await d.start()
        eng[0].kill()
        await d.get_batch(8, 0)
        health = eng[0].health

        async def counting_health():
            probed.append(d._update_lock.locked())
            return await health()
        eng[0].health = counting_health
        async with d.weight_update("in_place", 1):
            await asyncio.sleep(0.2)   # 20 probe intervals inside the window
        await asyncio.sleep(0.1)
        await d.stop()

    asyncio.run(main())
    assert probed and not any(probed)   # probed after the window, never during it


PROMPT_LEN = 23    # every arithmetic prompt of make_driver's source, in the char-level tokenizer


def test_requests_are_capped_to_the_context_so_none_is_refused():
    """prompt + max_new_tokens would pass the context (23 + 12 > 28): the driver asks for 5 tokens,
    the engine never refuses, and the samples end truncated at exactly the context."""
    cfg = make_cfg(max_new_tokens=12)
    eng = [ContextEngine("e0", context=PROMPT_LEN + 5, length_fn=lambda rng: 100, token_time_s=0.0005)]

    async def main():
        d = make_driver(eng, cfg, context_length=PROMPT_LEN + 5)
        await d.start()
        out = await d.get_batch(8, current_version=0)
        counts = dict(d.counts)
        await d.stop()
        return out, counts

    out, counts = asyncio.run(main())
    assert counts["failed"] == 0 and len(out) == 8
    assert {(n, m) for n, m in eng[0].requests} == {(PROMPT_LEN, 5)}
    assert all(s.status == SampleStatus.TRUNCATED and s.num_tokens == PROMPT_LEN + 5 for s in out)


def test_without_the_cap_the_same_engine_refuses_every_request():
    """The control for the test above: no context_length, every request is a 400 and the run stops."""
    cfg = make_cfg(max_new_tokens=12, max_failed_in_a_row=4)
    eng = [ContextEngine("e0", context=PROMPT_LEN + 5, length_fn=lambda rng: 100)]

    async def main():
        d = make_driver(eng, cfg)
        await d.start()
        try:
            with pytest.raises(DriverError, match="maximum context length of 28 tokens"):
                await d.get_batch(8, current_version=0)
        finally:
            await d.stop()

    asyncio.run(main())


def test_a_prompt_that_alone_does_not_fit_fails_its_sample_with_one_line_and_no_request():
    """Counted as a failure (never sent, never retried); failing every sample stops the run naming it."""
    cfg = make_cfg(max_new_tokens=12, max_failed_in_a_row=5)
    eng = [ContextEngine("e0", context=PROMPT_LEN)]

    async def main():
        d = make_driver(eng, cfg, context_length=PROMPT_LEN)
        await d.start()
        try:
            with pytest.raises(DriverError) as stopped:
                await d.get_batch(8, current_version=0)
            return str(stopped.value), dict(d.counts), list(d.recent_failures)
        finally:
            await d.stop()

    message, counts, failures = asyncio.run(main())
    reason = (f"prompt of {PROMPT_LEN} tokens does not fit the context of {PROMPT_LEN} tokens (model.max_seq_len); "
              "shorten the prompt or raise model.max_seq_len")
    assert message == f"5 samples failed in a row (rollout.max_failed_in_a_row=5); last: {reason}"
    assert "\n" not in message and counts["failed"] >= 5 and eng[0].requests == []
    assert all(why == reason for _, why in failures)


def test_fit_max_new_tokens():
    from rollout.context import PromptTooLong, fit_max_new_tokens

    assert fit_max_new_tokens(10, 10, 50, None) == 50
    assert fit_max_new_tokens(10, 10, 50, 100) == 50 and fit_max_new_tokens(10, 10, 95, 100) == 90
    assert fit_max_new_tokens(10, 100, 5, 100) == 0            # the context is full: end as length
    assert fit_max_new_tokens(99, 99, 5, 100) == 1
    with pytest.raises(PromptTooLong, match=r"prompt of 100 tokens does not fit the context of 100 tokens \(x\.y\)"):
        fit_max_new_tokens(100, 100, 5, 100, field="x.y")
