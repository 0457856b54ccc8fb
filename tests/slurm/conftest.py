"""The slurm tier: real sbatch/srun on the single-node cluster that .ci/slurm_setup.sh starts.

The `submit_recipe` fixture gives `submit(workdir, command, overrides)`, which renders a recipe with `sao launch --submit --wait` and
returns the job's exit code and log: the trainer command is one parameter, so the same helper
submits `sao train` (the default) or any smaller command.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_RECIPE = REPO / "recipes" / "tiny_moe_cpu.toml"
JOB_TIMEOUT_S = 600


def _cluster_problem() -> str:
    if not shutil.which("sbatch"):
        return "sbatch not found: slurm is not installed here (bash .ci/slurm_setup.sh installs a one-node cluster)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 30s: slurmctld is not running (bash .ci/slurm_setup.sh)"
    states = {s.strip("*~#") for s in out.stdout.split()}
    if out.returncode or not states & {"idle", "mixed", "allocated", "completing"}:
        return f"slurm is installed but no node is up (sinfo: {(out.stdout + out.stderr).strip() or 'no nodes'})"
    return ""


@pytest.fixture(scope="session")
def slurm_cluster():
    problem = _cluster_problem()
    if problem:
        pytest.skip(problem)


@dataclass
class JobResult:
    launch_rc: int       # exit code of `sao launch --submit --wait` (the job's exit code once it ran)
    stdout: str
    stderr: str
    log: str             # the job's slurm output file
    run_dir: Path


@pytest.fixture
def submit_recipe(slurm_cluster):
    """`submit(workdir, command=None, overrides=())`: command None submits `sao train` itself."""
    return submit


def submit(workdir: Path, command: str | None = None, overrides: list[str] = (), recipe: Path = TINY_RECIPE,
           wait: bool = True) -> JobResult:
    """`sao launch RECIPE --nodes 1 --submit [--wait]` on CPU, from `workdir`; command=None runs `sao train`."""
    waiting = ["--wait", "--wait-timeout", str(JOB_TIMEOUT_S)] if wait else []
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "launch", str(recipe), "--nodes", "1", "--submit",
           *waiting, "launch.gpus_per_node=0", f"launch.python='{sys.executable}'",
           "launch.time_limit='00:15:00'", *overrides]
    if command is not None:
        cmd += ["--train-command", command]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=JOB_TIMEOUT_S + 60)
    return collect(workdir, proc)


def collect(workdir: Path, proc) -> JobResult:
    # newest job last: by job id as a number (slurm-10.out sorts before slurm-9.out as text)
    logs = sorted(workdir.glob("runs/*/logs/slurm-*.out"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    run_dir = logs[-1].parents[1] if logs else workdir
    return JobResult(proc.returncode, proc.stdout, proc.stderr, logs[-1].read_text() if logs else "", run_dir)
