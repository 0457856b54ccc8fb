"""A fatal error on ONE rank of a multi-rank run (issue 15.3; sao_megatron/trainer/agreement.py).

Two gloo ranks run the real loop, checkpoints and rollout driver with a stand-in policy
(agreement_ranks.py). Rank 1 raises in its step 4 (checkpoint.interval = 2):
- in the advantage computation (local, before the optimizer step): the ranks agree at the next
  agreement point, every rank saves step 3 and exits 1 with one line naming rank 1; the resume trains
  step 4 once, on the batch the failure returned, and no sample is lost or trained twice;
- inside the policy's train_step before its gradient all-reduce (a collective region): no agreement is
  possible; rank 1 exits, rank 0's all-reduce fails because rank 1 is gone, both exit 1 and the previous
  checkpoint (step 2) is what a resume gets.
Rank 0's sample source failing (any error) stops every rank through the batch broadcast; all save.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import torch
from test_trainer_faults import assert_each_prompt_once

from checkpoints.run_state import RunCheckpointer
from sao_megatron.core.ports import free_port

REPO = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).with_name("agreement_ranks.py")
GENEROUS_S = 300   # turns a hang into a failure; the ranks end within seconds


def _run_ranks(run_dir: Path, steps: int, fault: str, tag: str) -> list[tuple[int, str, dict]]:
    """Start 2 ranks; (exit code, stderr, what the rank wrote) per rank."""
    port, procs, logs = free_port(), [], []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        logs.append(open(run_dir / f"{tag}.rank{rank}.stderr", "w+"))
        procs.append(subprocess.Popen([sys.executable, str(HELPER), str(run_dir), str(steps), fault], cwd=REPO,
                                      env=env, stdout=subprocess.DEVNULL, stderr=logs[-1], text=True))
    try:
        codes = [proc.wait(timeout=GENEROUS_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    out = []
    for rank, (code, log) in enumerate(zip(codes, logs)):
        log.seek(0)
        out.append((code, log.read(), json.loads((run_dir / f"rank{rank}.json").read_text())))
        log.close()
    return out


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def _load(ckpt: Path, name: str, rank: int):
    return torch.load(ckpt / f"{name}.rank{rank:05d}.pt", weights_only=False)


def test_rank_1_failing_before_the_update_is_agreed_every_rank_saves_and_the_resume_runs_the_step_once(tmp_path):
    ranks = _run_ranks(tmp_path, 6, "advantages@4:1", "first")
    root = tmp_path / "agree" / "checkpoints"
    for code, stderr, _ in ranks:
        assert code == 1, stderr[-3000:]
        lines = _error_lines(stderr)
        assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
        assert lines[0].startswith("error: rank 1 failed computing advantages: RuntimeError: injected fault in "
                                   "rank 1's step 4 (traceback: "), lines[0]
        assert lines[0].endswith("the last completed step is saved, by every rank (step_00000003)"), lines[0]
    assert "Traceback" in (tmp_path / "agree" / "error.rank00001.txt").read_text()
    ckpt = root / "step_00000003"
    assert (root / "latest").read_text() == ckpt.name
    top = RunCheckpointer(root, rank=0, world_size=1).verify_whole(ckpt)     # every file checksummed
    assert top["step"] == 3 and top["world_size"] == 2

    batches = ranks[0][2]["collected"]          # rank 0 collected step 4's batch before rank 1 failed
    assert len(batches) == 4
    for rank in range(2):
        assert _load(ckpt, "trainer", rank)["step"] == 3
        policy = _load(ckpt, "policy", rank)
        assert policy["updates"] == 3 and sorted(policy["trained"]) == sorted(sum(batches[:3], []))
    driver = _load(ckpt, "driver", 0)
    assert [d["uid"] for g in driver["buffer"]["ready"][:4] for d in g] == batches[3]   # back at the front
    assert_each_prompt_once(driver, sum(batches[:3], []))

    resumed = _run_ranks(tmp_path, 6, "none", "resume")
    for code, stderr, _ in resumed:
        assert code == 0, stderr[-3000:]
    assert "resumed from" in resumed[0][1] and "step_00000003 at step 3" in resumed[0][1]
    assert resumed[0][2]["collected"][0] == batches[3]           # step 4 runs on the returned batch
    final = root / "step_00000006"
    for rank in range(2):
        policy = _load(final, "policy", rank)
        assert policy["updates"] == 6
        assert len(policy["trained"]) == len(set(policy["trained"])) == 24   # step 4 trained once, nothing lost
        assert sorted(policy["trained"]) == sorted(sum(batches[:3] + resumed[0][2]["collected"], []))
    assert_each_prompt_once(_load(final, "driver", 0), _load(final, "policy", 0)["trained"])


def test_rank_1_failing_inside_a_collective_ends_both_ranks_and_keeps_the_previous_checkpoint(tmp_path):
    ranks = _run_ranks(tmp_path, 6, "update@4:1", "first")
    for code, stderr, _ in ranks:
        assert code == 1, stderr[-3000:]
        assert len(_error_lines(stderr)) == 1 and "Traceback" not in stderr, stderr[-3000:]
    (one,), (zero,) = _error_lines(ranks[1][1]), _error_lines(ranks[0][1])
    kept = ("no final checkpoint (a failure inside a collective cannot be agreed; the models may be mid-update); "
            "the previous checkpoint step_00000002 is kept")
    assert one.startswith("error: rank 1 failed updating the policy: RuntimeError: injected fault in rank 1's "
                          "step 4 (traceback: ") and one.endswith(kept), one
    # rank 0 waited in the gradient all-reduce: it ends when rank 1's process is gone, not at the timeout
    assert zero.startswith("error: rank 0 failed updating the policy: ") and "Connection closed by peer" in zero
    assert zero.endswith(kept), zero
    root = tmp_path / "agree" / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002"]
    assert (root / "latest").read_text() == "step_00000002"
    RunCheckpointer(root, rank=0, world_size=1).verify_whole(root / "step_00000002")


def test_rank_0s_sample_source_failing_with_a_bug_stops_every_rank_and_all_save(tmp_path):
    """Not a rollout failure (those are Stops already): any error of rank 0's sample source travels to
    the other ranks with the batch broadcast they wait in, so all of them save the last step."""
    ranks = _run_ranks(tmp_path, 6, "collect@4:0", "first")
    for code, stderr, _ in ranks:
        assert code == 1, stderr[-3000:]
        (line,) = _error_lines(stderr)
        assert line.startswith("error: rank 0 failed collecting samples: RuntimeError: injected fault in rank 0's "
                               "step 4 (traceback: ") and "Traceback" not in stderr, stderr[-3000:]
    root = tmp_path / "agree" / "checkpoints"
    assert (root / "latest").read_text() == "step_00000003"
    RunCheckpointer(root, rank=0, world_size=1).verify_whole(root / "step_00000003")
    batches = ranks[0][2]["collected"]
    assert len(batches) == 3
    assert_each_prompt_once(_load(root / "step_00000003", "driver", 0), sum(batches, []))


def test_a_rank_failure_escaping_the_loop_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    import parallel.distributed as dist
    from sao_megatron.core.config.recipe import Recipe
    from sao_megatron.trainer import checkpointing, entry
    from sao_megatron.trainer.agreement import RankFailed

    failed = RankFailed([1, 3], "rank 1 failed computing advantages: KeyError: 'x' (traceback: /r/error.rank00001.txt)",
                        agreed=True)
    failed.outcome = "the last completed step is saved, by every rank (step_00000007)"

    async def failing_train(recipe, rank, world, verified=None):
        raise failed

    monkeypatch.setattr(dist, "init_distributed", lambda *a, **k: types.SimpleNamespace(rank=0, world_size=4))
    monkeypatch.setattr(checkpointing, "resolve_resume", lambda recipe, rank, world, **kw: recipe)
    monkeypatch.setattr(entry, "_train", failing_train)
    recipe = Recipe()
    recipe.run.output_dir = str(tmp_path)
    assert entry.run_rank(recipe) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: rank 1 failed computing advantages: KeyError: 'x' (traceback: /r/error.rank00001.txt) (rank(s) [3] "
        f"failed too); the last completed step is saved, by every rank (step_00000007) (run dir {recipe.run_dir})"]
