"""A run directory under faults (issue 26.3-26.5): one writer (the run lock), Ctrl-C saves like SIGTERM and a
second signal exits at once, a resume cuts the metric rows after its step, and a checkpoint the disk refuses
(full, read-only) is one line with its temporary directory gone and the previous checkpoint intact."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from checkpoints import run_state
from checkpoints.run_state import CheckpointWriteError, RunCheckpointer, ValueState
from sao_megatron.cli.main import main
from sao_megatron.trainer import run_lock
from test_trainer_faults import _sao_train

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_moe_cpu.toml"
GENEROUS_S = 120   # turns a hang into a failure

HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from sao_megatron.trainer.run_lock import lock_run_dir
    lock_run_dir(Path(sys.argv[1]))
    print("locked", flush=True)
    sys.stdin.read()          # holds the lock until the test closes stdin or kills it
""")


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.fixture
def release_locks():
    yield
    run_lock.release_all()


# ---- 3. one writer per run directory ------------------------------------------------------------------
def test_a_second_sao_train_into_a_live_run_dir_is_one_line_exit_2_and_touches_nothing(tmp_path, capsys):
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = _holder(run_dir)
    try:
        before = _tree(run_dir)
        code = main(["train", str(TINY), f"run.output_dir='{tmp_path}'", "run.name='live'",
                     f"model.path='{tmp_path / 'model'}'"])
        after = _tree(run_dir)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "run.name" in err and f"in use by a live run (pid {holder.pid})" in err and "fix" in err, err
    assert after == before, "the refused run wrote into the live run's directory"
    assert not (tmp_path / "model").exists()


def test_a_lock_left_by_a_dead_process_is_taken_over_with_one_line(tmp_path, capsys, release_locks):
    holder = _holder(tmp_path)
    holder.kill()          # SIGKILL: no clean release, the kernel drops the flock, the pid stays in the file
    holder.wait(timeout=30)
    run_lock.lock_run_dir(tmp_path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"taking over the lock of pid {holder.pid}" in err, err
    assert (tmp_path / run_lock.LOCK_NAME).read_text().strip() == str(os.getpid())


def test_a_cleanly_released_lock_is_taken_silently_and_a_live_one_is_refused(tmp_path, capsys, release_locks):
    holder = _holder(tmp_path)
    holder.stdin.close()   # a clean exit empties the pid
    assert holder.wait(timeout=30) == 0
    run_lock.lock_run_dir(tmp_path)
    assert capsys.readouterr().err == ""
    probe = subprocess.run([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                           timeout=GENEROUS_S, stdin=subprocess.DEVNULL)
    assert probe.returncode != 0 and f"in use by a live run (pid {os.getpid()})" in probe.stderr


@pytest.mark.parametrize("env, locks", [({}, True), ({"RANK": "0"}, True), ({"RANK": "1"}, False),
                                        ({"SLURM_PROCID": "3"}, False), ({"OMPI_COMM_WORLD_RANK": "2"}, False)])
def test_only_the_launching_process_or_rank_0_takes_the_lock(tmp_path, monkeypatch, release_locks, env, locks):
    from sao_megatron.core.config import load_recipe
    from sao_megatron.trainer.entry import lock_if_first_rank

    for key in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    recipe = load_recipe(None, [f"run.output_dir='{tmp_path}'", "run.name='r'", "model.path='unused'"],
                         check_files=False)
    lock_if_first_rank(recipe)
    assert ((recipe.run_dir / run_lock.LOCK_NAME).is_file() and recipe.run_dir in run_lock._held) == locks


# ---- 4. Ctrl-C: as SIGTERM the first time, at once the second ----------------------------------------
SIGNALLED = textwrap.dedent("""
    import time
    from checkpoints.preemption import install_preemption_handlers, should_checkpoint_and_exit
    install_preemption_handlers()
    print("ready", flush=True)
    while not should_checkpoint_and_exit():
        time.sleep(0.01)
    print("saving", flush=True)     # the first signal: the safe point is reached, the save starts
    time.sleep(600)                 # a long save, which the second signal cuts short
""")


@pytest.mark.parametrize("first, second", [(signal.SIGINT, signal.SIGINT), (signal.SIGUSR1, signal.SIGTERM)])
def test_a_second_signal_exits_at_once_with_one_line(first, second):
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(first)
        assert proc.stdout.readline().strip() == "saving"     # the first one only set the flag
        proc.send_signal(second)
        _, err = proc.communicate(timeout=GENEROUS_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + second, err
    assert err.count("\n") == 1 and f"second signal ({second.name} after {first.name})" in err, err


def test_ctrl_c_at_the_terminal_of_a_two_rank_sao_train_saves_once_and_exits_0(tmp_path):
    """Ctrl-C signals the terminal's whole process group: only `sao train` is in it (torchrun runs in its own
    session), and it forwards one SIGINT to each rank; a second one per rank would exit without saving."""
    marker = tmp_path / "collecting"
    proc = _sao_train(tmp_path, "rollout.reward_fn='tests.faults.fault_rewards:hang_after_marking'",
                      "rollout.reward_timeout_s=3600", "parallel.pp=2", "parallel.launcher='torchrun'",
                      env={"SAO_FAULT_MARKER": str(marker)}, session=True)
    try:
        deadline = time.monotonic() + 600
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), proc.communicate(timeout=60)[1][-3000:]
        os.killpg(proc.pid, signal.SIGINT)      # what the terminal does on Ctrl-C
        _, err = proc.communicate(timeout=GENEROUS_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "done: stopped by SIGINT during collection after step 0, checkpoint saved" in err, err[-3000:]
    assert "second signal" not in err and "Traceback" not in err, err[-3000:]
    assert (tmp_path / "e2e" / "checkpoints" / "latest").read_text() == "step_00000000"


# ---- 4. a resume cuts the metric rows after its step -----------------------------------------------
def _rows(path: Path) -> list:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _sink_for(tmp_path, resume: str, wandb_id: str = "", wandb: bool = False):
    import contextlib

    from sao_megatron.core.config import load_recipe
    from sao_megatron.trainer.components import _build_sink

    recipe = load_recipe(None, [f"run.output_dir='{tmp_path}'", "run.name='r'", "model.path='unused'",
                                f"logging.wandb={str(wandb).lower()}", "logging.console=false", "logging.plot=false",
                                f"checkpoint.resume='{resume}'"], check_files=False)
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    if wandb_id:
        (recipe.run_dir / "wandb_run_id").write_text(wandb_id)
    with contextlib.ExitStack() as stack:
        sink = _build_sink(recipe, stack)
        return recipe.run_dir, sink.run_id


@pytest.mark.parametrize("resume, kept", [("step_00000005", [1, 2, 3, 4, 5]), ("never", []), ("auto", [1, 2, 3, 4, 5])])
def test_a_resume_cuts_metrics_back_to_its_step_so_no_step_repeats(tmp_path, capsys, resume, kept):
    run_dir = tmp_path / "r"
    ckpt = RunCheckpointer(run_dir / "checkpoints", rank=0, world_size=1).save(5, {"trainer": ValueState(dict, None)})
    # steps 6 and 7 were logged but not saved (a crash before the next checkpoint), then a torn line
    rows = [{"step": s, "x": 1.0} for s in [-2, -1, 1, 2, 3, 4, 5, 6, 7]]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "x"')
    _sink_for(tmp_path, str(ckpt) if resume.startswith("step_") else resume)
    assert _rows(run_dir / "metrics.jsonl") == kept
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"resuming at step {kept[-1] if kept else 0}, cut" in err, err


def test_a_resume_that_cuts_rows_logs_to_a_new_wandb_run_and_one_that_does_not_keeps_it(tmp_path):
    from sao_megatron.metrics.rewind import rewind_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert rewind_metrics(tmp_path, 2, "abc") == "abc"      # nothing after step 2: wandb resumes its run
    assert rewind_metrics(tmp_path, 1, "abc") == ""         # step 2 goes: a new wandb run
    assert _rows(tmp_path / "metrics.jsonl") == [1]


def test_wandb_resumes_its_run_unless_the_resume_cut_rows_then_logs_to_a_new_one(tmp_path):
    run_dir = tmp_path / "r"
    ckpt = RunCheckpointer(run_dir / "checkpoints", rank=0, world_size=1).save(2, {"trainer": ValueState(dict, None)})
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    _, first = _sink_for(tmp_path, str(ckpt), wandb=True)
    assert first and (run_dir / "wandb_run_id").read_text() == first
    _, same = _sink_for(tmp_path, str(ckpt), wandb=True)           # nothing after step 2: the same run
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    _, new = _sink_for(tmp_path, str(ckpt), wandb=True)            # step 3 is cut: wandb could not go back
    assert same == first and new not in ("", first) and (run_dir / "wandb_run_id").read_text() == new


def test_an_sft_that_starts_again_cuts_the_rows_of_the_earlier_one(tmp_path, capsys):
    from sao_megatron.core.config import load_recipe
    from sao_megatron.trainer.sft import _build_sink

    recipe = load_recipe(None, [f"run.output_dir='{tmp_path}'", "run.name='r'", "model.path='unused'",
                                "logging.wandb=false", "logging.console=false"], check_files=False)
    (recipe.run_dir / "sft").mkdir(parents=True)
    (recipe.run_dir / "sft" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    _build_sink(recipe).close()
    assert (recipe.run_dir / "sft" / "metrics.jsonl").read_text() == ""
    assert "cut 2 row(s)" in capsys.readouterr().err


# ---- 5. a checkpoint the disk refuses ------------------------------------------------------------
def _ckpt_with_one_save(tmp_path) -> tuple[RunCheckpointer, dict]:
    state = {"step": 1}
    ckpt = RunCheckpointer(tmp_path / "checkpoints", rank=0, world_size=1)
    parts = {"trainer": ValueState(lambda: state, state.update), "policy": ValueState(lambda: {"w": 1}, None)}
    ckpt.save(1, parts)
    return ckpt, parts


def test_disk_full_mid_save_removes_the_temp_dir_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt, parts = _ckpt_with_one_save(tmp_path)
    real = run_state._save_durably

    def fills_the_disk(obj, path):
        if path.name.startswith("policy"):
            path.write_bytes(b"partial")          # part of a file, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(obj, path)

    monkeypatch.setattr(run_state, "_save_durably", fills_the_disk)
    with pytest.raises(CheckpointWriteError) as raised:
        ckpt.save(2, parts)
    message = str(raised.value)
    assert "\n" not in message and "step_00000002" in message and "(ENOSPC)" in message, message
    assert "the previous checkpoint step_00000001 is intact" in message and "fix:" in message
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["latest", "step_00000001"]
    assert ckpt.choose("auto")[0].name == "step_00000001"     # verifies whole, checksums included


def test_read_only_checkpoint_dir_is_one_line_and_nothing_changes(tmp_path, monkeypatch):
    # tests run as root, where chmod does not stop writes: refuse at the OS call instead
    ckpt, parts = _ckpt_with_one_save(tmp_path)
    before = _tree(ckpt.root)
    real_mkdir = os.mkdir

    def read_only(path, *args, **kw):
        if Path(path).parent == ckpt.root:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kw)

    monkeypatch.setattr(os, "mkdir", read_only)
    with pytest.raises(CheckpointWriteError, match=r"Read-only file system \(EROFS\); the previous checkpoint "
                                                   r"step_00000001 is intact"):
        ckpt.save(2, parts)
    assert _tree(ckpt.root) == before


@pytest.mark.parametrize("where", ["1", "policy"], ids=["per_rank_file", "distributed_policy"])
def test_sao_train_disk_full_at_a_checkpoint_exits_1_with_one_line_and_keeps_the_previous(tmp_path, where):
    proc = _sao_train(tmp_path, "rollout.reward_fn='tests.faults.fault_rewards:zero_and_disk_full_from_step_2'",
                      "run.num_steps=3", "checkpoint.interval=1", env={"SAO_FAULT_DISK_FULL": where},
                      after=["critic.warmup_steps=10"])   # critic steps only: no weight sync needed
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: cannot write checkpoint step_00000002 in ") and "(ENOSPC)" in last, last
    assert "the previous checkpoint step_00000001 is intact" in last and "Traceback" not in err, err[-3000:]
    ckpt = tmp_path / "e2e" / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000001"]   # no .tmp-step_* left
    assert (ckpt / "latest").read_text() == "step_00000001"


class _ReadOnlyShards:
    """A distributed component whose writer fails as Megatron's torch_dist one does across ranks: torch's
    CheckpointException holding the worker's RuntimeError, its OSError cause lost in the pickling."""

    distributed_checkpoint = True

    def save_distributed(self, path):
        import traceback

        from torch.distributed.checkpoint.api import CheckpointException

        (path / "__0_0.distcp").write_bytes(b"partial")
        worker = RuntimeError(f"Worker failure: [Errno {errno.EROFS}] {os.strerror(errno.EROFS)}: '{path}'")
        raise CheckpointException("write", {0: (worker, traceback.StackSummary())})


def test_a_distributed_writer_refused_by_the_disk_is_the_same_one_line(tmp_path):
    ckpt, parts = _ckpt_with_one_save(tmp_path)
    with pytest.raises(CheckpointWriteError, match=r"Read-only file system \(EROFS\); the previous checkpoint "
                                                   r"step_00000001 is intact"):
        ckpt.save(2, {**parts, "policy": _ReadOnlyShards()})
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["latest", "step_00000001"]
