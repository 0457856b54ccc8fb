"""Jobs rendered by `sao launch` and run by real slurm: srun + rank bootstrap, exit codes, the CLI."""
from __future__ import annotations

import json
import re
import subprocess
import time


def test_two_srun_ranks_join_one_group_through_the_bootstrap(submit_recipe, tmp_path):
    job = submit_recipe(tmp_path, "{python} -m launch.bootstrap --check", ["parallel.world_size=2"])
    assert job.launch_rc == 0, job.stderr + job.log
    job_id = re.search(r"submitted job (\d+)", job.stdout).group(1)
    ranks = sorted((json.loads(line) for line in job.log.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [(r["rank"], r["world_size"], r["sum"]) for r in ranks] == [(0, 2, 3.0), (1, 2, 3.0)]
    # the script's MASTER_PORT rule: 20000 + job id % 20000, the same on both ranks
    assert {r["master"].split(":")[1] for r in ranks} == {str(20000 + int(job_id) % 20000)}
    assert (job.run_dir / "resolved_recipe.toml").is_file()


def test_the_jobs_exit_code_comes_back(submit_recipe, tmp_path):
    job = submit_recipe(tmp_path, "{python} -c 'import sys; sys.exit(3)'")
    assert job.launch_rc == 3
    assert "trainer finished with code 3" in job.log


def test_sao_cli_runs_inside_the_job(submit_recipe, tmp_path):
    job = submit_recipe(tmp_path, "{python} -m sao_megatron.cli.main plan {recipe}")
    # the tiny recipe's model is created by `sao train`; plan needs a config.json or a shape preset
    assert job.launch_rc == 2 and "model.shape_preset" in job.log
    job = submit_recipe(tmp_path, "{python} -m sao_megatron.cli.main --help")
    assert job.launch_rc == 0 and "usage: sao" in job.log


# A stand-in trainer that speaks the preemption protocol: on SIGUSR1 it "checkpoints" (writes a marker)
# and exits 0; after the requeue it finds the marker and finishes.
PREEMPTIBLE_TRAINER = """#!/bin/bash
if [ -f saved ]; then echo "resumed from $(cat saved) restart=${SLURM_RESTART_COUNT:-0}"; exit 0; fi
trap 'echo "got USR1, saving"; echo step7 > saved; exit 0' USR1
echo started > started
for i in $(seq 1 3000); do sleep 0.2; done
echo "no signal came"; exit 5
"""


def _job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"JobState=(\w+)", out)
    return match.group(1) if match else "GONE"


def _poll(condition, deadline_s: float, what: str) -> None:
    """Wait for a slurm-side event; the deadline only bounds a broken cluster, it asserts nothing about speed."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"slurm: {what} did not happen within {deadline_s:.0f}s")
        time.sleep(1)


def test_usr1_before_the_time_limit_checkpoints_requeues_and_resumes(submit_recipe, tmp_path):
    trainer = tmp_path / "trainer.sh"
    trainer.write_text(PREEMPTIBLE_TRAINER)
    job = submit_recipe(tmp_path, f"bash {trainer}", wait=False)
    assert job.launch_rc == 0, job.stderr
    job_id = re.search(r"submitted job (\d+)", job.stdout).group(1)
    _poll(lambda: (tmp_path / "started").exists(), 300, "the trainer step starting")
    time.sleep(1)  # the stand-in installs its trap right before writing 'started'
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)  # what --signal=B:USR1 does
    _poll(lambda: _job_state(job_id) in ("COMPLETED", "FAILED", "CANCELLED", "GONE"), 600, "the requeued job finishing")
    log = next(tmp_path.glob("runs/*/logs/slurm-*.out")).read_text()
    assert _job_state(job_id) in ("COMPLETED", "GONE"), log
    assert "got USR1, saving" in log and f"requeueing job {job_id}" in log
    assert "resumed from step7 restart=1" in log and "trainer finished with code 0" in log


def test_sao_train_tiny_recipe_trains_and_checkpoints_under_slurm(submit_recipe, tmp_path):
    job = submit_recipe(tmp_path, None, ["run.num_steps=2", "critic.warmup_steps=1", "rollout.batch_size=8",
                                         "rollout.max_in_flight=8", "logging.wandb=false"])
    assert job.launch_rc == 0, job.stderr + job.log
    rows = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "train/pg_clipfrac" in rows[-1] and "critic/vf_loss" in rows[-1]
    assert (job.run_dir / "checkpoints" / "latest").exists()
    assert "weight version 2" in job.log
