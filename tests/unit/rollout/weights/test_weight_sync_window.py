"""The trainer's weight-update window (sao_megatron/trainer/weight_updates.py) and the rollout driver's part
in it, against fake engines that record their control calls in order:
pause -> one session per engine -> every sender -> session closed -> prefix cache settled -> continue;
a failure of the driver rank or of any rank's push reaches every rank (2 gloo ranks)."""
from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from checkpoints.init_model import build_tokenizer
from parallel.distributed import DistributedTestError, run_distributed_test
from rollout.driver import RolloutDriver
from rollout.prompts import build_prompt_source
from rollout.rewards import resolve_reward_fn
from rollout.engines.scripted import ScriptedEngine as FakeEngine
from rollout.weights.plan import SenderRole, plan_weight_update
from sao_megatron.core.config.schema import RolloutConfig
from sao_megatron.core.dims import ParallelDims
from sao_megatron.trainer.weight_updates import WeightUpdates, new_weight_sync

TOK = build_tokenizer()


def _driver(engines):
    cfg = RolloutConfig(task="arithmetic", batch_size=4, max_in_flight=4, max_new_tokens=40, staleness_bound=100,
                        request_timeout_s=30.0, reward_timeout_s=5.0)
    source = build_prompt_source(cfg, TOK, seed=0, num_problems=64)
    return RolloutDriver(engines, source, resolve_reward_fn(cfg), cfg, TOK, seed=0, probe_interval_s=0.01)


class SessionSync:
    """A WeightSync stand-in: the session calls go to the engines, a push is recorded on each."""

    def __init__(self, engines, fail: bool = False):
        self.engines, self.fail = engines, fail

    @contextlib.asynccontextmanager
    async def update_session(self):
        for e in self.engines:
            await e.begin_weight_update()
        try:
            yield
        finally:
            for e in self.engines:
                await e.end_weight_update()

    async def push(self, named, version):
        count = len(list(named))
        for e in self.engines:
            e.calls.append(f"push v{version}: {count} tensors" if not self.fail else "push failed")
        if self.fail:
            raise RuntimeError("bucket 0 refused")
        for e in self.engines:
            e.version = version


def _window(engines, driver, mode="in_place", fail=False, rank=0, world_size=1, sender=None):
    """A WeightUpdates with only what the window touches."""
    policy = SimpleNamespace(export_hf=lambda scope="all", snapshot=True: iter([("w", None)] * 3))
    recipe = SimpleNamespace(weight_sync=SimpleNamespace(pause_mode=mode, timeout_s=30.0, check_equal=False,
                                                         method="broadcast", senders="per_stage"),
                             parallel=SimpleNamespace(pp=1), run=SimpleNamespace(debug="none"))
    plan = plan_weight_update(ParallelDims(dp=world_size), recipe.weight_sync, len(engines), 1)
    return WeightUpdates(recipe, policy, engines, driver, sender or SessionSync(engines, fail), rank, world_size, plan)


@pytest.mark.parametrize("mode, flushed", [("in_place", False), ("retract", True), ("abort", True)])
def test_window_order_per_pause_mode(mode, flushed):
    engines = [FakeEngine("e0", token_time_s=0.002), FakeEngine("e1", token_time_s=0.002)]

    async def main():
        driver = _driver(engines)
        await driver.start()
        await asyncio.sleep(0.05)                     # requests in flight when the update starts
        await _window(engines, driver, mode)._update_weights(1, pause=True)
        for _ in range(10):                           # room in the buffer: new prompts are drawn
            await driver.get_batch(4, 1)
            if any("sao-w1" in e.namespaces.values() for e in engines):
                break
        await driver.stop()

    asyncio.run(main())
    for e in engines:
        control = [c for c in e.calls if c not in ("abort",)]
        expected = [f"pause:{mode}", "begin_weight_update", "push v1: 3 tensors", "end_weight_update"]
        expected += ["flush_cache"] if flushed else []
        assert control[:len(expected) + 1] == expected + ["continue"], control
        assert e.cache_namespace == "sao-w1" and not e.session_open
        sent = [e.namespaces[r] for r in e.rids]      # requests before the update, then only after it
        assert sent == sorted(sent, key=lambda n: n is not None) and set(sent) <= {None, "sao-w1"}
    assert any("sao-w1" in e.namespaces.values() for e in engines)   # new requests use the new namespace


def test_in_place_never_flushes_while_paused_requests_hold_kv():
    """The fake refuses /flush_cache while requests paused in place run, as SGLang does: the window
    must not ask (it would fail the update) and still moves the namespace."""
    engines = [FakeEngine("e0", token_time_s=0.005, length_fn=lambda rng: 40)]

    async def main():
        driver = _driver(engines)
        await driver.start()
        await asyncio.sleep(0.05)
        running = len(engines[0]._running)
        await _window(engines, driver, "in_place")._update_weights(2, pause=True)
        await driver.stop()
        return running

    assert asyncio.run(main()) > 0
    assert "flush_cache" not in engines[0].calls and engines[0].cache_namespace == "sao-w2"


def test_failed_push_still_closes_the_session_and_resumes():
    engines = [FakeEngine("e0")]

    async def main():
        driver = _driver(engines)
        await driver.start()
        with pytest.raises(RuntimeError, match="bucket 0 refused"):
            await _window(engines, driver, "abort", fail=True)._update_weights(3, pause=True)
        await driver.stop()

    asyncio.run(main())
    calls = engines[0].calls
    assert calls[:4] == ["pause:abort", "begin_weight_update", "push failed", "end_weight_update"]
    assert calls[-1] == "abort" and "continue" in calls and not engines[0].session_open   # stop() aborts last


def test_resume_push_opens_a_session_without_pausing():
    """At resume nothing runs yet: no pause, one session, then the idle engines are flushed."""
    engines = [FakeEngine("e0")]
    asyncio.run(_window(engines, None)._update_weights(4, pause=False))
    assert engines[0].calls == ["begin_weight_update", "push v4: 3 tensors", "end_weight_update", "flush_cache"]
    assert engines[0].cache_namespace == "sao-w4"


def _two_rank_window(fail_rank: int) -> str:
    """Rank 0 (the driver rank) opens the window, or fails to when fail_rank is 0; rank 1's push fails
    when fail_rank is 1. Returns what this rank raised."""
    import torch.distributed as dist

    rank = dist.get_rank()
    engines = [FakeEngine("e0")]
    sender = SessionSync([FakeEngine("stage-sender-view")], fail=rank == fail_rank) if rank != 0 else None
    window = _window(engines, None, fail=rank == fail_rank, rank=rank, world_size=2, sender=sender)
    if fail_rank == 0:
        async def broken(window, version, pause):
            raise ConnectionError("engine e0: /begin_weight_update failed")
        window._open_window = broken
    try:
        asyncio.run(window._update_weights(5, pause=False))
    except Exception as err:  # noqa: BLE001 - the outcome is the test's result
        return f"{type(err).__name__}: {err}"
    return "ok"


@pytest.mark.parametrize("fail_rank, other", [(0, "the driver rank could not open the weight update"),
                                              (1, "the weight push of rank 1 failed")])
def test_a_failure_on_one_rank_reaches_every_rank(fail_rank, other):
    try:
        outcomes = run_distributed_test(_two_rank_window, world_size=2, timeout_s=300, args=(fail_rank,))
    except DistributedTestError as err:
        pytest.fail(f"a rank hung or died instead of failing: {err}")
    failed, bystander = outcomes[fail_rank], outcomes[1 - fail_rank]
    assert failed.startswith(("ConnectionError", "RuntimeError: bucket 0 refused")), failed
    assert other in bystander, bystander


def test_engines_are_built_from_the_recipe(tiny_model_dir, tmp_path, monkeypatch):
    """Reference engines start with --tp rollout.engine_tp; the weight sync counts that many ranks per
    engine; the clients know the routes' shape from config.json (SGLang's /model_info does not say)."""
    import rollout.engines.reference_server as reference_server
    from sao_megatron.core.config import load_recipe
    from sao_megatron.trainer import engines as engines_mod

    launched = []
    monkeypatch.setattr(reference_server, "launch_local", lambda *a, **kw: launched.append(kw.get("extra_args")))
    recipe = load_recipe(None, [f"model.path='{tiny_model_dir}'", "rollout.engine_tp=2"])
    engines_mod.launch_engine(recipe, 0, "k", tmp_path)
    recipe_tp1 = load_recipe(None, [f"model.path='{tiny_model_dir}'"])
    engines_mod.launch_engine(recipe_tp1, 1, "k", tmp_path)
    assert launched == [["--tp", "2"], ["--tp", "1"]]

    clients = engines_mod.engine_clients(recipe, ["http://127.0.0.1:1", "http://127.0.0.1:2"], "k")
    assert [(c.moe_topk, c.num_layers) for c in clients] == [(2, 4), (2, 4)]
    sync = new_weight_sync(recipe, clients, SenderRole(rank=2, kind="stage", scope="stage", stage=1))
    assert sync.engine_ranks == [2, 2] and sync.rank_offsets() == [1, 3] and sync.stage == 1


def test_engine_tp_below_one_is_refused_by_name(tiny_model_dir):
    from sao_megatron.core.config import ConfigError, load_recipe

    with pytest.raises(ConfigError, match="rollout.engine_tp"):
        load_recipe(None, [f"model.path='{tiny_model_dir}'", "rollout.engine_tp=0"])
