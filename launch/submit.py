"""Submit a rendered script with sbatch, optionally wait for the job, and report what happened."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SBATCH_TIMEOUT_S = 60.0   # sbatch itself answers in seconds; a hung controller should not hang us


@dataclass(frozen=True)
class Submission:
    job_id: str
    exit_code: int | None   # None when not waited for
    log: Path


def require_sbatch() -> str:
    sbatch = shutil.which("sbatch")
    if not sbatch:
        raise RuntimeError("sbatch is not on PATH: run on a slurm login node, or use --dry-run / no --submit "
                           "to only write the script (CI: bash .ci/slurm_setup.sh starts a one-node cluster)")
    return sbatch


def submit(script: Path, run_dir: Path, wait: bool = False, wait_timeout_s: float = 86400.0) -> Submission:
    """sbatch --parsable [--wait] SCRIPT. With wait, the job's exit code comes back; at the timeout the
    job is cancelled and RuntimeError says so."""
    cmd = [require_sbatch(), "--parsable"] + (["--wait"] if wait else []) + [str(script)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline().strip()  # --parsable prints "jobid[;cluster]" at once, even with --wait
    job_id = first.split(";")[0]
    try:
        out, err = proc.communicate(timeout=wait_timeout_s if wait else SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        if job_id:
            subprocess.run(["scancel", job_id], timeout=SBATCH_TIMEOUT_S, check=False)
        raise RuntimeError(f"job {job_id or '?'} did not finish within {wait_timeout_s:.0f}s; cancelled it") from None
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch failed (code {proc.returncode}): {(first + out + err).strip()[-2000:]}")
    log = run_dir / "logs" / f"slurm-{job_id}.out"
    return Submission(job_id, proc.returncode if wait else None, log)
