"""Trainer faults (issue 15.3): the real loop (`Trainer`), driver and checkpoints, with scripted engines.

Each case asserts the one-line error or the recovery, and that no step or sample is lost or
duplicated: the checkpoint's step counter, and every drawn prompt's uid found exactly once among the
batches trained, the samples that failed, and the checkpoint's buffer and in-flight work.
The model is a stand-in (rollout-only steps: trains=False); what is checked is the loop's stopping,
saving and resuming, which does not depend on the model.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from agreement_ranks import FakePolicy

from checkpoints import preemption
from checkpoints.init_model import build_tokenizer
from checkpoints.run_state import ValueState
from rollout.driver import RolloutDriver
from rollout.engines.engine import EngineError
from rollout.prompts import build_prompt_source
from rollout.rewards import resolve_reward_fn
from rollout.engines.scripted import ScriptedEngine
from sao_megatron.core.config import load_recipe
from sao_megatron.core.processes import pid_alive
from sao_megatron.trainer.checkpointing import Checkpoints
from sao_megatron.trainer.components import Components
from sao_megatron.trainer.loop import Trainer
from sao_megatron.trainer.state import TrainerState
from sao_megatron.trainer.stopping import CollectionStopped
from sao_megatron.trainer.weight_updates import NoWeightUpdates

TOK = build_tokenizer()
GENEROUS_S = 120   # turns a hang into a failure; the bounded times asserted are far below it


pytestmark = pytest.mark.usefixtures("preemption_signals_restored")


class Run:
    """One trainer over scripted engines; records the uids of every batch it trained on."""

    def __init__(self, tmp, engines, steps: int, reward_fn=None, policy=None, **rollout):
        opts = dict(task="arithmetic", batch_size=4, max_in_flight=4, max_new_tokens=8, staleness_bound=100,
                    request_timeout_s=30.0, reward_timeout_s=5.0) | rollout
        overrides = [f"run.output_dir='{tmp}'", "run.name='faults'", f"run.num_steps={steps}", "model.path='unused'",
                     "critic.warmup_steps=0", "checkpoint.interval=0"]
        if policy is not None:   # a training run: a stand-in policy (agreement_ranks.FakePolicy), no critic
            overrides += ["algorithm.name='running_mean'", "algorithm.mini_batches=1"]
        overrides += [f"rollout.{k}={v!r}" if isinstance(v, str) else f"rollout.{k}={str(v).lower()}"
                      for k, v in opts.items()]
        self.recipe = load_recipe(None, overrides, check_files=False)
        cfg = self.recipe.rollout
        source = build_prompt_source(cfg, TOK, seed=0, num_problems=256)
        self.driver = RolloutDriver(engines, source, reward_fn or resolve_reward_fn(cfg), cfg, TOK, seed=0,
                                    probe_interval_s=0.02)
        self.model = {"updates": 0}
        trains, policy = policy is not None, policy or ValueState(lambda: self.model, self.model.update)
        self.checkpoints = Checkpoints(self.recipe, 0, 1, saves=True)
        parts = Components(0, 1, policy, None, self.driver, NoWeightUpdates(), self.checkpoints, trains=trains)
        self.state = TrainerState()
        self.trainer = Trainer(self.recipe, parts, self.state)
        self.trained: list[str] = []
        get_batch = self.driver.get_batch

        async def recording(*args, **kw):
            batch = await get_batch(*args, **kw)
            self.trained += [s.uid for s in batch]
            return batch

        self.driver.get_batch = recording

    async def train(self):
        try:
            await asyncio.wait_for(self.trainer.train(), GENEROUS_S)
        finally:
            await self.driver.stop()

    def latest(self):
        return self.checkpoints.checkpointer.latest()

    def saved(self) -> dict:
        """The latest checkpoint's trainer state, driver state and policy state."""
        ckpt = self.latest()
        return {name: torch.load(ckpt / f"{name}.rank00000.pt", weights_only=False)
                for name in ("trainer", "driver", "policy")}


def saved_uids(driver_state: dict) -> list[str]:
    buffer = driver_state["buffer"]
    return ([d["uid"] for g in buffer["ready"] for d in g] + [d["uid"] for d in buffer["partial"]]
            + [d["uid"] for d in driver_state["work"]])


def assert_each_prompt_once(driver_state: dict, *accounted: list[str]) -> None:
    """Every prompt drawn up to the checkpoint is in exactly one place (failed ones counted apart)."""
    uids = [u for group in accounted for u in group] + saved_uids(driver_state)
    assert len(uids) == len(set(uids)), "a sample is in two places"
    drawn = driver_state["prompt_source"]["drawn"]
    assert sorted(int(u[1:].split("-")[0]) for u in uids) == list(range(drawn))


def failed_uids(run: Run, saved_driver: dict | None = None, before: int = 0) -> list[str]:
    """Samples that failed in this run; with `saved_driver`, only those that failed before that
    checkpoint was taken (a sample failing after the save is still in its saved work, to be re-issued
    on resume). `before`: failures the run resumed with (its counts start there, its list does not)."""
    uids = [uid for uid, _ in run.driver.recent_failures]
    return uids if saved_driver is None else uids[:saved_driver["counts"]["failed"] - before]


class RejectingEngine(ScriptedEngine):
    """Answers normally for `good` requests, then rejects every request as SGLang does a bad value."""

    def __init__(self, name="e0", good: int = 0, **kw):
        super().__init__(name, token_time_s=0.0005, **kw)
        self.good = good

    async def generate(self, request):
        if len(self.rids) >= self.good:
            self.rids.append(request.rid)
            raise EngineError(f"engine {self.name}: /generate answered HTTP 400: top_k must be -1 or >= 1")
        return await super().generate(request)


# ---- 1. every sample failing stops the run in bounded time, one line, the last step saved ----------
def test_engine_rejecting_everything_stops_with_one_line_and_saves_the_last_step(tmp_path):
    run = Run(tmp_path, [RejectingEngine(good=8)], steps=5, max_failed_in_a_row=6)
    started = time.monotonic()
    with pytest.raises(CollectionStopped) as err:
        asyncio.run(run.train())
    message = str(err.value)
    assert "\n" not in message and time.monotonic() - started < GENEROUS_S / 2
    assert "6 samples failed in a row (rollout.max_failed_in_a_row=6)" in message
    assert "HTTP 400: top_k must be -1 or >= 1" in message
    assert "generation failed after 1 attempt(s)" in message   # a refused request is not retried
    assert not err.value.stop.preempted and not run.driver._dead   # and the engine is not taken for dead
    assert run.state.step == 2 and run.latest().name == "step_00000002"   # the two good steps, saved
    saved = run.saved()
    assert saved["trainer"]["step"] == 2
    assert_each_prompt_once(saved["driver"], run.trained, failed_uids(run, saved["driver"]))


def test_reward_that_always_times_out_stops_naming_the_reward(tmp_path):
    async def never(sample):
        await asyncio.sleep(3600)

    run = Run(tmp_path, [ScriptedEngine("e0", token_time_s=0.0005)], steps=3, reward_fn=never,
              reward_timeout_s=0.05, max_failed_in_a_row=4)
    with pytest.raises(CollectionStopped) as err:
        asyncio.run(run.train())
    assert "4 samples failed in a row" in str(err.value)
    assert "reward timed out after 0.05s (rollout.reward_timeout_s)" in str(err.value)
    assert run.state.step == 0 and run.saved()["trainer"]["step"] == 0


def test_transient_engine_failures_still_retry_and_the_run_finishes(tmp_path):
    engines = [ScriptedEngine(f"e{i}", token_time_s=0.0005, fail_prob=0.5, seed=i, length_fn=lambda rng: 4)
               for i in range(2)]
    run = Run(tmp_path, engines, steps=3, max_failed_in_a_row=4)
    asyncio.run(run.train())
    assert run.state.step == 3 and run.latest().name == "step_00000003"
    assert run.driver.counts["engine_errors"] > 0          # failures happened and were retried
    assert len(run.trained) == 12 and len(set(run.trained)) == 12


def test_max_failed_in_a_row_defaults_to_twice_max_in_flight(tmp_path):
    run = Run(tmp_path, [ScriptedEngine("e0")], steps=1, max_in_flight=8)
    assert run.driver.max_failed_in_a_row == 16


# ---- 2. engines down: named within rollout.engine_down_timeout_s, not 670 s ------------------------
def test_dead_engine_is_reported_within_engine_down_timeout(tmp_path):
    engine = ScriptedEngine("e0", token_time_s=0.0005)
    run = Run(tmp_path, [engine], steps=5, engine_down_timeout_s=1.0)

    async def kill_after_first_step():
        while run.state.step < 1:
            await asyncio.sleep(0.01)
        engine.kill()

    async def main():
        killer = asyncio.create_task(kill_after_first_step())
        try:
            await run.train()
        finally:
            killer.cancel()

    started = time.monotonic()
    with pytest.raises(CollectionStopped) as err:
        asyncio.run(main())
    assert "all engines are down (['e0']) for 1s (rollout.engine_down_timeout_s)" in str(err.value)
    assert time.monotonic() - started < 30
    assert run.saved()["trainer"]["step"] == run.state.step >= 1


class SilentEngine(ScriptedEngine):
    """A process that is up but answers nothing once `silence()` is called: requests hang, /health fails."""

    def silence(self):
        self.token_time_s = 3600.0
        self.silent = True

    async def health(self) -> bool:
        return not getattr(self, "silent", False)


def test_engine_that_goes_silent_is_taken_for_dead_and_its_requests_reissued(tmp_path):
    # e0 is slow enough that the run still collects when e1's silence reaches engine_down_timeout_s
    e0, e1 = ScriptedEngine("e0", token_time_s=0.05), SilentEngine("e1", token_time_s=0.002)
    run = Run(tmp_path, [e0, e1], steps=4, engine_down_timeout_s=0.5, request_timeout_s=600.0)

    async def silence_after_first_step():
        while run.state.step < 1:
            await asyncio.sleep(0.005)
        e1.silence()

    async def main():
        silencer = asyncio.create_task(silence_after_first_step())
        await run.train()
        await silencer

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < GENEROUS_S / 2      # not request_timeout_s (600 s)
    assert run.state.step == 4 and "e1" in run.driver._dead
    reissued = [rid for rid in e0.rids if not rid.endswith("-a0")]
    assert reissued, "no request of the silent engine was re-issued"
    saved = run.saved()
    assert_each_prompt_once(saved["driver"], run.trained, failed_uids(run, saved["driver"]))


def test_engine_down_timeout_defaults_to_60s():
    recipe = load_recipe(None, ["model.path='unused'"], check_files=False)
    assert recipe.rollout.engine_down_timeout_s == 60.0


# ---- 3. SIGTERM / SIGUSR1 / SIGINT (Ctrl-C) during collection: stop, save the last completed step, resume exactly
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_during_collection_saves_last_step_and_resume_loses_nothing(tmp_path, sig):
    engine = ScriptedEngine("e0", token_time_s=0.0005)
    run = Run(tmp_path, [engine], steps=4)

    async def signal_while_collecting():
        while run.state.step < 2:
            await asyncio.sleep(0.005)
        engine.token_time_s = 3600.0       # step 3's samples hang in flight, partly generated
        while not engine._running:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), sig)

    async def main():
        sender = asyncio.create_task(signal_while_collecting())
        await run.train()
        await sender

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < GENEROUS_S / 2
    assert run.trainer.stopped is not None and sig.name in str(run.trainer.stopped) and run.trainer.saved_at_stop
    # the engine hangs from step 2 on; on a loaded machine step 3's samples may already be buffered, so
    # the signal can land while step 3 or step 4 collects: the last completed step is what is saved
    stopped_at = run.state.step
    assert stopped_at in (2, 3) and run.latest().name == f"step_{stopped_at:08d}"
    saved = run.saved()
    assert saved["trainer"]["step"] == stopped_at
    assert saved["driver"]["work"], "the in-flight samples were not saved"
    assert_each_prompt_once(saved["driver"], run.trained, failed_uids(run, saved["driver"]))
    first = list(run.trained)

    preemption.clear()
    resumed = Run(tmp_path, [ScriptedEngine("e1", token_time_s=0.0005)], steps=4)
    asyncio.run(resumed.train())
    assert resumed.state.step == 4 and resumed.latest().name == "step_00000004"
    in_flight_at_stop = {d["uid"] for d in saved["driver"]["work"]}
    assert in_flight_at_stop <= set(resumed.trained + saved_uids(resumed.saved()["driver"]))
    assert_each_prompt_once(resumed.saved()["driver"], first, resumed.trained, failed_uids(run, saved["driver"]),
                            failed_uids(resumed, resumed.saved()["driver"], before=saved["driver"]["counts"]["failed"]))


# ---- 4. a fatal error: saved when the state is consistent, not when a model is mid-update ---------
def test_fatal_error_between_steps_saves_the_last_completed_step(tmp_path, monkeypatch):
    run = Run(tmp_path, [ScriptedEngine("e0", token_time_s=0.0005)], steps=4)
    calls = {"n": 0}

    def log_then_fail(metrics, step):
        calls["n"] += 1
        if step == 2:
            raise RuntimeError("metric sink is gone")

    monkeypatch.setattr(run.trainer, "log", log_then_fail)
    with pytest.raises(RuntimeError, match="metric sink is gone"):
        asyncio.run(run.train())
    assert run.latest().name == "step_00000002" and run.saved()["trainer"]["step"] == 2


def test_fatal_error_mid_update_keeps_the_previous_checkpoint(tmp_path):
    def fail_on_third():
        if run.state.step == 2:
            raise RuntimeError("update failed")

    run = Run(tmp_path, [ScriptedEngine("e0", token_time_s=0.0005)], steps=4, policy=FakePolicy(fail_on_third))
    with pytest.raises(RuntimeError, match="update failed"):
        asyncio.run(run.train())
    assert run.state.step == 2
    assert run.latest() is None      # interval 0: nothing saved, and nothing written mid-update


def test_fatal_error_before_the_update_saves_the_step_start_with_its_batch_back(tmp_path, monkeypatch):
    """A failure after the batch was taken but before any model update (here: the advantages) saves the
    last completed step as it was when the step began, its batch back at the front of the buffer: the
    resume trains that batch at the same step, once."""
    from sao_megatron.trainer import steps

    run = Run(tmp_path, [ScriptedEngine("e0", token_time_s=0.0005)], steps=4, policy=FakePolicy())
    real = steps.compute_step_advantages

    def fail_on_third(*args):
        if run.state.step == 2:
            raise RuntimeError("advantages failed")
        return real(*args)

    monkeypatch.setattr(steps, "compute_step_advantages", fail_on_third)
    with pytest.raises(RuntimeError, match="advantages failed"):
        asyncio.run(run.train())
    monkeypatch.setattr(steps, "compute_step_advantages", real)
    batches = [run.trained[i:i + 4] for i in range(0, len(run.trained), 4)]
    assert len(batches) == 3 and run.latest().name == "step_00000002"
    saved = run.saved()
    assert saved["trainer"]["step"] == 2 and saved["policy"]["updates"] == 2
    assert sorted(saved["policy"]["trained"]) == sorted(batches[0] + batches[1])
    assert [d["uid"] for g in saved["driver"]["buffer"]["ready"][:4] for d in g] == batches[2]   # at the front
    assert_each_prompt_once(saved["driver"], batches[0] + batches[1])

    resumed = Run(tmp_path, [ScriptedEngine("e1", token_time_s=0.0005)], steps=4, policy=FakePolicy())
    asyncio.run(resumed.train())
    assert resumed.trained[:4] == batches[2]            # step 3 trains the batch the failure returned
    final = resumed.saved()
    assert final["trainer"]["step"] == 4 and final["policy"]["updates"] == 4
    trained = final["policy"]["trained"]
    assert len(trained) == len(set(trained)) == 16      # every sample trained once
    assert_each_prompt_once(final["driver"], trained)


# ---- 5. children die with the run, SIGKILL included ----------------------------------------------
ORPHAN_MAKER = textwrap.dedent("""
    import multiprocessing as mp, subprocess, sys, time
    from sao_megatron.core.processes import reap_descendants_at_exit
    if __name__ == "__main__":
        assert reap_descendants_at_exit()
        manager = mp.get_context("spawn").Manager()      # what Megatron's checkpoint writer starts
        detached = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                    start_new_session=True)
        print(manager._process.pid, detached.pid, flush=True)
        time.sleep(600)
""")


def test_children_die_with_a_sigkilled_trainer(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(ORPHAN_MAKER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    children = []
    try:
        children = [int(p) for p in proc.stdout.readline().split()]
        assert len(children) == 2 and all(pid_alive(p) for p in children)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + GENEROUS_S
        while any(_running(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(p) for p in children), "a child outlived the SIGKILLed trainer"
    finally:
        for pid in children:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its (new) parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---- 6. an engine that dies mid-run: restarted when started here, in-flight requests re-issued -----
def test_restarted_engine_waits_out_of_rotation_until_a_weight_update_gives_it_the_current_version(tmp_path):
    e0, e1 = ScriptedEngine("e0", token_time_s=0.001, version=1), ScriptedEngine("e1", token_time_s=0.001, version=1)
    run = Run(tmp_path, [e0, e1], steps=1)
    driver = run.driver

    async def main():
        await driver.start()
        await driver.get_batch(4, current_version=1)
        e1.version = 0                           # a new process: the initial weights
        driver.engine_restarting("e1")
        driver.engine_restarted("e1", ok=True)
        await asyncio.sleep(0.2)                 # calls placed on e1 before the restart reach it
        before = len(e1.rids)
        await driver.get_batch(4, current_version=1)
        await asyncio.sleep(0.2)                 # probes pass /health, yet e1 stays out
        assert "e1" in driver._dead and len(e1.rids) == before
        async with driver.weight_update("abort"):
            e0.version = e1.version = 2          # the update reaches the restarted engine too
        while "e1" in driver._dead:              # the probe brings it back now
            await asyncio.sleep(0.01)
        batch = []
        while len(e1.rids) == before:
            batch += await driver.get_batch(4, current_version=2)
        await driver.stop()
        return before, batch

    before, batch = asyncio.run(asyncio.wait_for(main(), GENEROUS_S))
    assert e1.version == 2 and all(set(s.weight_versions) <= {1, 2} for s in batch)   # never version 0


def test_locally_started_engine_killed_mid_collection_is_restarted_and_nothing_is_lost(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from sao_megatron.trainer.engine_restarts import EngineRestarts
    from sao_megatron.trainer.engines import start_engines

    recipe = load_recipe(None, [f"model.path='{tiny_model_dir}'", f"run.output_dir='{tmp_path}'", "run.name='restart'",
                                "rollout.task='arithmetic'", "rollout.batch_size=4", "rollout.max_in_flight=4",
                                "rollout.max_new_tokens=64", "rollout.engine_restarts=1"], check_files=False)
    recipe.run_dir.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    async def main():
        engines, handles = await start_engines(recipe, recipe.run_dir)
        driver = RolloutDriver(engines, build_prompt_source(recipe.rollout, tokenizer, seed=0, num_problems=64),
                               resolve_reward_fn(recipe.rollout), recipe.rollout, tokenizer, seed=0,
                               probe_interval_s=0.1)
        restarts = EngineRestarts(recipe, engines, handles, driver, recipe.run_dir)
        try:
            await driver.start()
            restarts.start()
            first = await driver.get_batch(4, current_version=0)
            # kill while a request is on the engine itself (a sample in _active may be between calls),
            # with responses long enough that it cannot have answered yet
            while not driver._load[engines[0].name]:
                await asyncio.sleep(0.001)
            in_flight = set(driver._active)
            old_pid = handles[0].process.pid
            os.kill(old_pid, signal.SIGKILL)
            # samples buffered before the kill may fill a batch at once: read on until the restart is
            # recorded and every sample in flight at the kill has come back (bounded)
            second = []
            for _ in range(8):
                second += await asyncio.wait_for(driver.get_batch(4, current_version=0), GENEROUS_S * 2)
                if restarts.restarts and in_flight <= {s.uid for s in second}:
                    break
            new_pid = restarts.slots[engines[0].name][1].process.pid
            return first, second, in_flight, old_pid, new_pid, restarts.restarts, driver.state_dict(), driver.counts
        finally:
            await driver.stop()
            await restarts.stop()
            for engine in engines:
                await engine.close()

    first, second, in_flight, old_pid, new_pid, restarted, state, counts = asyncio.run(main())
    assert len(restarted) == 1 and restarted[0].startswith("engine0@")
    assert new_pid != old_pid and counts["engine_errors"] >= 1
    reissued = [s for s in second if int(s.metadata.get("attempts", 0)) > 1]
    assert reissued, "no sample in flight at the kill was re-issued"
    assert in_flight <= {s.uid for s in second} | set(saved_uids(state))   # each one finished or still held
    assert_each_prompt_once(state, [s.uid for s in first + second], [])


# ---- 7. `sao train` itself: SIGTERM mid-collection exits 0 with the step saved; a fault is one line
REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def _sao_train(tmp, *overrides, env=None, after=(), session=False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "train", str(REPO / "recipes" / "tiny_moe_cpu.toml"),
           f"run.output_dir='{tmp}'", "run.name='e2e'", f"model.path='{tmp / 'model'}'", "rollout.batch_size=4",
           "rollout.max_in_flight=4", "logging.wandb=false", "logging.plot=false", "logging.console=false",
           "critic.warmup_steps=0", *overrides, *after]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=session)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sao_train_sigterm_during_collection_saves_and_exits_0(tmp_path, sig):
    marker = tmp_path / "collecting"
    proc = _sao_train(tmp_path, "rollout.reward_fn='tests.faults.fault_rewards:hang_after_marking'",
                      "rollout.reward_timeout_s=3600", env={"SAO_FAULT_MARKER": str(marker)}, session=True)
    try:
        deadline = time.monotonic() + 600
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), proc.communicate(timeout=60)[1][-3000:]
        assert_holds_the_run_lock(tmp_path / "e2e", proc.pid)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)   # Ctrl-C: the terminal signals the whole group, the engine too
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=GENEROUS_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert f"done: stopped by {sig.name} during collection after step 0, checkpoint saved" in err
    assert (tmp_path / "e2e" / ".sao.lock").read_text() == ""     # released on the way out: nothing to take over
    ckpt = tmp_path / "e2e" / "checkpoints"
    assert (ckpt / "latest").read_text() == "step_00000000"
    driver = torch.load(ckpt / "step_00000000" / "driver.rank00000.pt", weights_only=False)
    assert driver["work"] and all(d["reward"] is None for d in driver["work"])   # in flight, kept for the resume


def assert_holds_the_run_lock(run_dir, pid: int) -> None:
    """The live run holds its run dir's flock (a second writer cannot take it) and has written its pid."""
    import fcntl

    assert (run_dir / ".sao.lock").read_text().strip() == str(pid)
    with open(run_dir / ".sao.lock") as f, pytest.raises(BlockingIOError):
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_sao_train_sigkilled_mid_collection_leaves_no_process_behind(tmp_path):
    marker = tmp_path / "collecting"
    proc = _sao_train(tmp_path, "rollout.reward_fn='tests.faults.fault_rewards:hang_after_marking'",
                      "rollout.reward_timeout_s=3600", env={"SAO_FAULT_MARKER": str(marker)})
    tagged = f"SAO_FAULT_MARKER={marker}".encode()   # every process of this run inherits it
    try:
        deadline = time.monotonic() + 600
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), proc.communicate(timeout=60)[1][-3000:]
        family = [pid for pid in _pids_with(tagged) if pid != proc.pid]
        assert family, "the run started no process (engine) to check"
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + GENEROUS_S
        while [p for p in _pids_with(tagged) if _running(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in _pids_with(tagged) if _running(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the SIGKILLed trainer: {left}"


def _pids_with(env_entry: bytes) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if entry.isdigit() and env_entry in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_sao_train_reward_failing_every_sample_exits_1_with_one_line(tmp_path):
    proc = _sao_train(tmp_path, "rollout.reward_fn='tests.faults.fault_rewards:always_raise'",
                      "rollout.max_failed_in_a_row=6")
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: 6 samples failed in a row (rollout.max_failed_in_a_row=6); last: reward raised "
                           "RuntimeError: the reward service is down"), last
    assert "Traceback" not in err
    assert (tmp_path / "e2e" / "checkpoints" / "latest").read_text() == "step_00000000"


# ---- 8. local multi-rank: a preemption signal reaches the ranks, not the launcher ------------------
FAKE_RANK = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    def saved(signum, frame):
        Path(sys.argv[1]).write_text(signal.Signals(signum).name)   # 'checkpoint', then a clean exit
        sys.exit(0)
    signal.signal(signal.SIGUSR1, saved)
    signal.signal(signal.SIGTERM, saved)
    signal.signal(signal.SIGINT, saved)
    Path(sys.argv[1] + ".ready").touch()
    time.sleep(600)
    sys.exit(3)
""")
FAKE_LAUNCHER = textwrap.dedent("""
    import subprocess, sys
    ranks = [subprocess.Popen([sys.executable, sys.argv[1], f"{sys.argv[2]}/rank{r}"]) for r in range(2)]
    sys.exit(max(p.wait() for p in ranks))      # dies on SIGUSR1 itself, as torchrun does
""")
TOP = textwrap.dedent("""
    import subprocess, sys
    from sao_megatron.core.processes import forward_signals_to_children
    from checkpoints.preemption import DEFAULT_SIGNALS
    launcher = subprocess.Popen([sys.executable] + sys.argv[1:])
    with forward_signals_to_children(launcher.pid, DEFAULT_SIGNALS):
        sys.exit(launcher.wait())
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_top_process_forwards_preemption_signals_to_the_ranks(tmp_path, sig):
    for name, text in [("rank.py", FAKE_RANK), ("launcher.py", FAKE_LAUNCHER), ("top.py", TOP)]:
        (tmp_path / name).write_text(text)
    top = subprocess.Popen([sys.executable, str(tmp_path / "top.py"), str(tmp_path / "launcher.py"),
                            str(tmp_path / "rank.py"), str(tmp_path)], cwd=REPO)
    try:
        deadline = time.monotonic() + GENEROUS_S
        while not all((tmp_path / f"rank{r}.ready").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        top.send_signal(sig)
        assert top.wait(timeout=GENEROUS_S) == 0
    finally:
        if top.poll() is None:
            top.kill()
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [sig.name, sig.name]
