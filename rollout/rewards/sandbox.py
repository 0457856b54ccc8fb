"""Run untrusted Python (model-written code) isolated by the OS.

``isolation="bwrap"`` (the default, recipe field ``rollout.sandbox``): bubblewrap gives the run its
own pid/network/ipc namespaces, a fresh /proc, an empty environment, a read-only view of /usr and
the Python installation, a working dir and /tmp that are size-capped tmpfs mounts (a write quota that
never touches the host disk; their file count is checked from here, _over_quota), and rlimits (CPU
seconds strictly below the wall limit, address space, file size, processes, open files) before the
interpreter starts;
as root it also runs under a fresh unprivileged uid (sandbox_bwrap.py), and a seccomp filter refuses
namespaces, mounts, ptrace, bpf and other kernel attack surface (sandbox_seccomp.py; where libseccomp
is missing the run goes ahead without it and ``SandboxResult.seccomp`` is False). Where bwrap is missing or
cannot create namespaces, ``run_python`` raises ``SandboxUnavailable`` with one line naming the fix
and the recipe field: it never silently runs untrusted code without isolation.

``isolation="unsafe-no-isolation"`` (opt-in, in so many words): a plain subprocess with rlimits, an
empty network namespace where ``unshare -n`` works, and the in-process audit-hook guard only.

In both modes the guard of sandbox_guard.py runs first (clear errors for common mistakes, not a
boundary); wall time kills the run; at the end the whole sandbox is gone: under bwrap the pid
namespace's init is killed, so the kernel kills every process in it (a setsid child included), and
bwrap exits only after that; stdout/stderr go to files the file-size limit also bounds.
"""
from __future__ import annotations

import asyncio
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rollout.rewards.sandbox_bwrap import (ENV, SANDBOX_DIR, UNSAFE, NamespaceInit, SandboxUnavailable, bwrap_command, mib,
                                   nproc_for, pick_uid, require_bwrap, rlimit_args)
from rollout.rewards.sandbox_guard import GUARD
from rollout.rewards.sandbox_seccomp import program_fd

ISOLATIONS = ("bwrap", UNSAFE)
TAIL_BYTES = 64 * 1024   # the code reward's results line is read from here
QUOTA_POLL_S = 0.02
__all__ = ["ISOLATIONS", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python",
           "network_namespace_available"]


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. ``cpu_time_s`` defaults to one second under the wall limit (at least 1) and must
    stay below it, so a CPU spin is stopped by the kernel (limit "cpu_time") before the wall clock."""

    wall_time_s: float = 10.0
    cpu_time_s: Optional[int] = None
    memory_mb: int = 512
    file_size_mb: int = 8
    open_files: int = 64
    max_processes: int = 32          # RLIMIT_NPROC: processes and threads of the run
    tmp_mb: int = 64                 # size of the private /tmp (bwrap)
    write_mb: int = 64               # size of the working dir, a tmpfs too (bwrap): with tmp_mb, all a run can write
    max_files: int = 2048            # files and dirs in the working dir and /tmp together (bwrap; see _over_quota)
    max_output_bytes: int = 64 * 1024
    network: bool = False
    isolation: str = "bwrap"         # or "unsafe-no-isolation" (rollout.sandbox)

    def __post_init__(self):
        if self.cpu_time_s is None:
            object.__setattr__(self, "cpu_time_s", max(1, math.ceil(self.wall_time_s) - 1))
        if not self.cpu_time_s < self.wall_time_s:
            raise ValueError(f"SandboxLimits.cpu_time_s={self.cpu_time_s} is not below wall_time_s="
                             f"{self.wall_time_s}: a CPU spin would hit the wall clock first; lower cpu_time_s")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"SandboxLimits.isolation={self.isolation!r} is not one of {ISOLATIONS} "
                             "(recipe field rollout.sandbox)")


@dataclass
class SandboxResult:
    returncode: int                    # negative signal number when a signal ended the program
    stdout: str                        # the first max_output_bytes
    stderr: str
    limit: Optional[str] = None        # "wall_time" | "cpu_time" | "memory" | "file_size" | "write_quota" | "files"
    network_isolated: bool = False     # the run had no network (own namespace)
    stdout_tail: str = ""              # the last 64 KiB of stdout, however long it was
    isolation: str = "bwrap"
    seccomp: bool = False              # the run had the seccomp filter (bwrap with libseccomp here)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.limit is None


@functools.lru_cache(maxsize=1)
def network_namespace_command() -> list[str]:
    """Unsafe mode only: the prefix that runs a command in an empty network namespace, or [] if none works."""
    if not shutil.which("unshare"):
        return []
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        try:
            if subprocess.run(prefix + ["true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    return []


def network_namespace_available() -> bool:
    return bool(network_namespace_command())


async def run_python(code: str, limits: SandboxLimits = SandboxLimits(),
                     files: Optional[dict[str, str]] = None) -> SandboxResult:
    """Run `code` as a script in a fresh working dir (with `files` written into it first) under `limits`.

    Raises SandboxUnavailable when limits.isolation is "bwrap" and bwrap cannot isolate here.
    """
    if limits.isolation == "bwrap":
        require_bwrap()
    scratch = Path(tempfile.mkdtemp(prefix="sao-sandbox-"))
    try:
        return await _run_in(scratch, code, limits, files or {})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _limit_arg(limits: SandboxLimits) -> str:
    return f"{limits.cpu_time_s},{mib(limits.memory_mb)},{mib(limits.file_size_mb)},{limits.open_files}"


def _command(scratch: Path, limits: SandboxLimits, info_fd: Optional[int], seccomp_fd: Optional[int],
             file_fds: list[tuple[int, str]]) -> tuple[list[str], Path, bool]:
    """(argv, the launcher's working dir, network isolated) for the run's isolation mode."""
    box = scratch / "box"
    box.mkdir(mode=0o700)
    if limits.isolation == "bwrap":   # the run's own working dir is a tmpfs inside: `box` stays empty
        guard_argv = [sys.executable, "-I", f"{SANDBOX_DIR}/_guard.py", SANDBOX_DIR, f"{SANDBOX_DIR}/main.py",
                      "1" if limits.network else "0", _limit_arg(limits)]
        rlimits = rlimit_args(limits.cpu_time_s, mib(limits.memory_mb), mib(limits.file_size_mb),
                              limits.open_files, nproc_for(limits.max_processes))
        cmd = bwrap_command(guard_argv, uid=pick_uid(), limits=rlimits, network=limits.network,
                            tmp_bytes=mib(limits.tmp_mb), work_bytes=mib(limits.write_mb), file_fds=file_fds,
                            info_fd=info_fd, seccomp_fd=seccomp_fd)
        return cmd, box, not limits.network
    unshare = network_namespace_command() if not limits.network else []
    cmd = unshare + [sys.executable, "-I", str(box / "_guard.py"), str(box), str(box / "main.py"),
                     "1" if limits.network else "0", _limit_arg(limits)]
    return cmd, box, bool(unshare)


async def _run_in(scratch: Path, code: str, limits: SandboxLimits, files: dict[str, str]) -> SandboxResult:
    bwrap = limits.isolation == "bwrap"
    info_r, info_w = os.pipe() if bwrap else (-1, -1)
    init = NamespaceInit(info_r) if bwrap else None
    seccomp_fd = program_fd() if bwrap else None
    contents = {**files, "_guard.py": GUARD, "main.py": code}
    file_fds = [(_memfd(name, text), name) for name, text in contents.items()] if bwrap else []
    inherited = tuple(fd for fd in (info_w, seccomp_fd) if fd is not None and fd >= 0) + tuple(f for f, _ in file_fds)
    try:
        cmd, box, isolated = _command(scratch, limits, info_w if bwrap else None, seccomp_fd, file_fds)
        if not bwrap:
            for name, text in contents.items():
                (box / name).write_text(text)
        with open(scratch / ".stdout", "wb") as out, open(scratch / ".stderr", "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err, cwd=box,
                env=_env(limits, box), start_new_session=True, pass_fds=inherited)
    except BaseException:
        if init:
            os.close(info_r)    # nothing will read bwrap's info: init.learn, which closes it, never runs
        raise
    finally:
        for fd in inherited:
            os.close(fd)
    learned = asyncio.ensure_future(asyncio.to_thread(init.learn)) if init else None
    stopped_by = await _wait(proc, init, learned, limits)
    returncode = _signal_code(proc.returncode) if bwrap else proc.returncode
    stdout = _read_head(scratch / ".stdout", limits.max_output_bytes)
    stderr = _read_head(scratch / ".stderr", limits.max_output_bytes)
    limit = stopped_by or _which_limit(returncode, stderr)
    return SandboxResult(returncode, stdout, stderr, limit, isolated, _read_tail(scratch / ".stdout"),
                         limits.isolation, seccomp_fd is not None)


async def _wait(proc, init: Optional[NamespaceInit], learned, limits: SandboxLimits) -> Optional[str]:
    """Wait for the run up to the wall limit, checking the file count every QUOTA_POLL_S; on return
    nothing of it is alive. "wall_time" or "files" when that stopped it, else None."""
    loop = asyncio.get_running_loop()
    deadline, stopped_by = loop.time() + limits.wall_time_s, None
    exited = asyncio.ensure_future(proc.wait())
    try:
        while stopped_by is None:
            done, _ = await asyncio.wait([exited], timeout=min(QUOTA_POLL_S, max(0.0, deadline - loop.time())))
            if done:
                break
            if _over_quota(init, learned, limits):
                stopped_by = "files"
            elif loop.time() >= deadline:
                stopped_by = "wall_time"
    finally:
        await _stop(proc, init, learned)
    return stopped_by


def _over_quota(init: Optional[NamespaceInit], learned, limits: SandboxLimits) -> bool:
    """More files than limits.max_files in the run's tmpfs mounts. bwrap cannot pass tmpfs's
    nr_inodes option (only --size), so the count is read from outside every QUOTA_POLL_S and the run
    killed past it: what one poll interval lets a program create beyond the quota is the slack."""
    if init is None or not learned.done():
        return False
    used = init.files_used()
    return used is not None and used > limits.max_files


def _memfd(name: str, text: str) -> int:
    """An anonymous in-memory file holding `text`, read from the start by bwrap's --file."""
    fd = os.memfd_create(f"sao-sandbox-{name}", 0)
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _env(limits: SandboxLimits, box: Path) -> dict[str, str]:
    """A minimal environment for the launcher itself (bwrap's pid 1 inside keeps the one it started with)."""
    return dict(ENV) if limits.isolation == "bwrap" else {**ENV, "HOME": str(box)}


def _signal_code(returncode: int) -> int:
    """bwrap reports a command killed by signal N as exit 128 + N; give it back as -N like Popen does."""
    return -(returncode - 128) if 128 < returncode < 128 + signal.NSIG else returncode


async def _stop(proc, init: Optional[NamespaceInit], learned) -> None:
    """Kill whatever is left. Under bwrap: pid 1 of the sandbox's pid namespace (the kernel then kills
    every process in it, setsid ones included) and wait until it has exited, which happens only once
    the namespace is empty; bwrap may report the command's exit before that."""
    if init is None:                               # unsafe mode: the process group is all we know
        if proc.returncode is None:
            _killpg(proc.pid)
            await proc.wait()
        return
    if proc.returncode is None:
        await asyncio.wait([learned], timeout=10)
        if not learned.done():                     # bwrap never started pid 1: stop it, then read EOF
            _killpg(proc.pid)
    await learned
    if proc.returncode is None or not await asyncio.to_thread(init.wait_gone, 10):
        init.kill()
    await asyncio.to_thread(init.wait_gone, 30)
    init.close()
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except asyncio.TimeoutError:
        _killpg(proc.pid)
        await proc.wait()


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _which_limit(returncode: int, stderr: str) -> Optional[str]:
    if "No space left on device" in stderr:   # the working dir's or /tmp's tmpfs is full
        return "write_quota"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_time"
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return "file_size"
    if "MemoryError" in stderr:
        return "memory"
    return None


def _read_head(path: Path, limit: int) -> str:
    with open(path, "rb") as fh:
        return fh.read(limit).decode("utf-8", errors="replace")


def _read_tail(path: Path) -> str:
    with open(path, "rb") as fh:
        fh.seek(max(0, os.fstat(fh.fileno()).st_size - TAIL_BYTES))
        return fh.read().decode("utf-8", errors="replace")
