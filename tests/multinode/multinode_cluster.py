"""Helpers of the multi-node tier: three slurm nodes in network namespaces (.ci/multinode_setup.sh) on 10.77.0.0/24.

Every job goes through `sao launch ... --submit` against that cluster's slurm.conf (SLURM_CONF). The
namespaces share this machine's filesystem and pid space, so a test reads the run directory directly
and looks at each node's sockets with `ss` run inside the node's namespace (`NodeSockets`).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_RECIPE = REPO / "recipes" / "tiny_moe_cpu.toml"
CONF = "/etc/slurm-multinode/slurm.conf"
NODES = {"saon1": ("sao-n1", "10.77.0.11"), "saon2": ("sao-n2", "10.77.0.12"), "saon3": ("sao-n3", "10.77.0.13")}
JOB_TIMEOUT_S = 900   # turns a hung cluster into a failure; says nothing about speed
SLURM_ENV = dict(os.environ, SLURM_CONF=CONF)
# A tiny run: a few steps of 8 samples, sampled weights checked on the engines after every sync.
TRAIN = ["critic.warmup_steps=1", "rollout.batch_size=8", "rollout.max_in_flight=8", "logging.wandb=false",
         "weight_sync.check_equal=true"]


def cluster_problem() -> str:
    """Why the tier cannot run here ('' when it can): setup's own reason first when it wrote one."""
    failed = Path("/var/log/slurm-multinode/setup_failed")
    if failed.is_file():
        return f".ci/multinode_setup.sh could not build the cluster: {failed.read_text().strip()}"
    if os.geteuid() != 0:
        return "the multi-node tier needs root (network namespaces and slurm daemons): run .ci/multinode_setup.sh as root"
    if not shutil.which("sbatch") or not Path(CONF).is_file():
        return f"no multi-node cluster ({CONF} missing): run bash .ci/multinode_setup.sh (as root) first"
    if not all(Path(f"/run/netns/{ns}").exists() for ns, _ in NODES.values()):
        return "the network namespaces sao-n1..3 are missing: run bash .ci/multinode_setup.sh"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30,
                             env=SLURM_ENV)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 30s: the multi-node slurmctld is not running (bash .ci/multinode_setup.sh)"
    up = {line.split()[0] for line in out.stdout.splitlines()
          if line.split()[1].strip("*~#") in ("idle", "mixed", "allocated", "completing")}
    if out.returncode or up != set(NODES):
        return f"the multi-node cluster is not up (sinfo: {(out.stdout + out.stderr).strip() or 'no nodes'})"
    return ""


@dataclass
class Job:
    launch_rc: int
    stdout: str
    stderr: str
    workdir: Path
    job_id: str = ""
    run_dir: Path = field(default=None)

    def log(self) -> str:
        logs = sorted(self.run_dir.glob("logs/slurm-*.out")) if self.run_dir else []
        return logs[-1].read_text() if logs else ""


def launch(workdir: Path, nodes: int, overrides: list[str], command: str | None = None, wait: bool = True) -> Job:
    """`sao launch tiny_moe_cpu.toml --nodes N --submit` on the multi-node cluster, from `workdir`. With
    `wait`, launch_rc is the job's exit code: polled every second here, since `sbatch --wait` (what
    `sao launch --wait` runs) sleeps up to 32 s between its own polls."""
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "launch", str(TINY_RECIPE), "--nodes", str(nodes),
           "--submit", "launch.gpus_per_node=0", f"launch.python='{sys.executable}'",
           "launch.time_limit='00:15:00'", *overrides]
    if command is not None:
        cmd += ["--train-command", command]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=120, env=SLURM_ENV)
    match = re.search(r"submitted job (\d+)", proc.stdout)
    runs = sorted(p.parent for p in workdir.glob("runs/*/resolved_recipe.toml"))
    job = Job(proc.returncode, proc.stdout, proc.stderr, workdir, match.group(1) if match else "",
              runs[-1] if runs else None)
    if wait and job.job_id:
        job.launch_rc = wait_for(job.job_id)
    return job


def sbatch(script: Path) -> str:
    """Submit a hand-written script; its job id."""
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60,
                         env=SLURM_ENV, check=True).stdout
    return out.strip().split(";")[0]


def wait_for(job_id: str) -> int:
    """Block until the job ends; its exit code (slurm's ExitCode=N:signal)."""
    poll(lambda: job_state(job_id) in ENDED, JOB_TIMEOUT_S, f"job {job_id} ending", every_s=1.0)
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30,
                         env=SLURM_ENV).stdout
    match = re.search(r"\bExitCode=(\d+):(\d+)", out)
    return int(match.group(1)) or int(match.group(2)) if match else -1


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "GONE")


def job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30,
                         env=SLURM_ENV).stdout
    match = re.search(r"JobState=(\w+)", out)
    return match.group(1) if match else "GONE"


def poll(condition, deadline_s: float, what: str, every_s: float = 0.5) -> None:
    """Wait for a cluster-side event; the deadline bounds a broken cluster, not the speed of the run."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"multinode: {what} did not happen within {deadline_s:.0f}s")
        time.sleep(every_s)


def scontrol(*args: str) -> None:
    subprocess.run(["scontrol", *args], check=True, capture_output=True, timeout=30, env=SLURM_ENV)


# ------------------------------------------------------------------------------------------ sockets


def ss(namespace: str, *args: str) -> list[tuple[str, str, str, str]]:
    """(state, local, peer, process) of the TCP sockets in a node's namespace (`ss -tnp`)."""
    out = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-Htnp", *args], capture_output=True,
                         text=True, timeout=30).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 5:
            rows.append((parts[0], parts[3], parts[4], " ".join(parts[5:])))
    return rows


@dataclass
class NodeSockets:
    """Samples every node's TCP sockets (listening and connected) while a job runs."""

    seen: dict = field(default_factory=lambda: {name: set() for name in NODES})
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread = None

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, (namespace, _) in NODES.items():
                self.seen[name].update(ss(namespace, "-a"))
            self._stop.wait(0.3)

    def listening(self, node: str, process: str = "python") -> set[str]:
        """Local addresses (addr:port) `process` listened on at `node`."""
        return {local for state, local, _, proc in self.seen[node] if state == "LISTEN" and f'"{process}' in proc}

    def connected(self, node: str) -> set[tuple[str, str]]:
        return {(local, peer) for state, local, peer, _ in self.seen[node] if state == "ESTAB"}


def wildcard(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host in ("0.0.0.0", "*", "[::]", "[::ffff:0.0.0.0]")
