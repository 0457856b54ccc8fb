"""Rank bootstrap: launcher variables -> RankInfo -> torchrun env, and real 2-rank groups under a
faked srun and under mpirun."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch.bootstrap import RankInfo, discover, expand_nodelist, export_torch_env, job_port, master_endpoint
from sao_megatron.core.ports import free_port

REPO = Path(__file__).resolve().parents[3]


def test_torchrun_variables():
    env = dict(RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4")
    assert discover(env) == RankInfo(3, 8, 1, 4, "torchrun")


def test_srun_variables_and_tasks_per_node():
    env = dict(SLURM_PROCID="9", SLURM_NTASKS="11", SLURM_LOCALID="1", SLURM_NODEID="2",
               SLURM_STEP_TASKS_PER_NODE="4(x2),3")
    assert discover(env) == RankInfo(9, 11, 1, 3, "srun")


def test_mpirun_inside_an_allocation_beats_the_batch_steps_slurm_rank():
    env = dict(SLURM_PROCID="0", SLURM_NTASKS="1", OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="6",
               OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    assert discover(env) == RankInfo(5, 6, 1, 2, "mpirun")


def test_no_launcher_is_a_single_process():
    assert discover({}) == RankInfo(0, 1, 0, 1, "single")


def test_bad_launcher_variable_names_it():
    with pytest.raises(RuntimeError, match="SLURM_PROCID='x'"):
        discover(dict(SLURM_PROCID="x", SLURM_NTASKS="2"))


def test_expand_nodelist_like_scontrol():
    assert expand_nodelist("gpu[01-03,07],login5") == ["gpu01", "gpu02", "gpu03", "gpu07", "login5"]
    assert expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_nodelist("vm") == ["vm"]


def test_srun_master_is_first_node_and_port_follows_the_job_id():
    info = RankInfo(1, 2, 1, 2, "srun")
    env = dict(SLURM_JOB_NODELIST="a[3-4]", SLURM_JOB_ID="123457")
    assert master_endpoint(info, env) == ("a3", 20000 + 123457 % 20000)
    assert job_port("20001") == 20001
    assert master_endpoint(info, dict(env, MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")) == ("10.0.0.1", 29500)


def test_torchrun_without_master_fails_clearly():
    with pytest.raises(RuntimeError, match="MASTER_ADDR/MASTER_PORT are not set"):
        master_endpoint(RankInfo(0, 2, 0, 2, "torchrun"), {})


def test_export_writes_torchrun_convention():
    env = export_torch_env(RankInfo(2, 4, 0, 2, "srun"), "h1", 1234, {})
    assert env == dict(RANK="2", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="h1",
                       MASTER_PORT="1234")


def _clean_env() -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI")) and k not in drop}
    env["PYTHONPATH"] = str(REPO)
    return env


def _results(stdout: str) -> list[dict]:
    return sorted((json.loads(line) for line in stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])


def test_two_ranks_under_faked_srun_join_one_gloo_group():
    port = free_port("127.0.0.1")
    procs = []
    for rank in range(2):
        env = dict(_clean_env(), SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   SLURM_STEP_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "launch.bootstrap", "--check"], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    results = _results("".join(o[0] for o in outs))
    assert [(r["rank"], r["source"], r["local_world_size"], r["sum"]) for r in results] == \
        [(0, "srun", 2, 3.0), (1, "srun", 2, 3.0)]


@pytest.mark.skipif(shutil.which("mpirun", path=str(Path(sys.executable).parent) + os.pathsep +
                                 os.environ.get("PATH", "")) is None, reason="mpirun is not installed")
def test_two_ranks_under_mpirun_broadcast_the_master():
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    env = dict(_clean_env(), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run([mpirun, "-np", "2", "--oversubscribe", sys.executable, "-m", "launch.bootstrap", "--check"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = _results(proc.stdout)
    assert [(r["rank"], r["source"], r["world_size"], r["sum"]) for r in results] == \
        [(0, "mpirun", 2, 3.0), (1, "mpirun", 2, 3.0)]
    assert results[0]["master"] == results[1]["master"]  # rank 0's choice reached rank 1


def test_exec_mode_hands_the_torchrun_env_to_the_command():
    env = dict(_clean_env(), SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_JOB_ID="77",
               SLURM_JOB_NODELIST="node[5-6]")
    proc = subprocess.run([sys.executable, "-m", "launch.bootstrap", "--", "sh", "-c",
                           "echo $RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $MASTER_PORT"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["1", "2", "0", "node5", "20077"]
