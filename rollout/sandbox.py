"""Run untrusted Python (model-written code) in a limited subprocess.

Layers, from the kernel up:
- rlimits set by the child's guard before any user code runs (not in a preexec_fn, which can
  deadlock in a threaded parent): CPU seconds (RLIMIT_CPU -> SIGXCPU), address space
  (RLIMIT_AS -> MemoryError), size of any written file (RLIMIT_FSIZE -> SIGXFSZ/EFBIG), open files,
  no core dumps; the child gets its own session so the whole process group is killed on timeout;
- wall time: the parent kills the process group after ``wall_time_s``;
- network: the child runs under ``unshare -n`` (an empty network namespace: no interfaces but a
  down loopback) when the platform allows it (root or unprivileged user namespaces). Where it
  does not, ``SandboxResult.network_isolated`` is False and the audit hook below is the only guard;
- files and processes: a guard installs a Python audit hook (PEP 578) before the code runs. It refuses
  writes, deletes, renames, links and chdir outside the scratch directory, reads outside the scratch
  directory and the Python installation, sockets, subprocesses/exec/fork, and ctypes. Audit hooks
  cannot be removed from Python code, but they are not a boundary against native code; run the
  trainer in a container for real isolation;
- a fresh scratch directory per run (the working directory), removed afterwards; stdout/stderr go to
  files in it, so the file-size limit also bounds the output.
"""
from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

GUARD = r'''
import os, resource, sys
# limits first, before any user code: cpu_s, as_bytes, fsize_bytes, nofile
CPU, AS, FSIZE, NOFILE = (int(x) for x in sys.argv[4].split(","))
resource.setrlimit(resource.RLIMIT_CPU, (CPU, CPU + 1))
resource.setrlimit(resource.RLIMIT_AS, (AS, AS))
resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE, FSIZE))
resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
SCRATCH = os.path.realpath(sys.argv[1])
READ_ROOTS = [SCRATCH] + sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                              os.path.dirname(os.__file__))})
NETWORK = sys.argv[3] == "1"
BLOCKED = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
           "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "pty.spawn", "os.kill", "os.killpg",
           "resource.setrlimit", "resource.prlimit")
PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.replace": (0, 1), "os.mkdir": (0,),
               "os.chmod": (0,), "os.chown": (0,), "os.link": (0, 1), "os.symlink": (0, 1), "os.truncate": (0,),
               "os.utime": (0,), "os.chdir": (0,), "shutil.rmtree": (0,), "shutil.move": (0, 1),
               "shutil.copyfile": (1,), "os.listdir": (0,), "os.scandir": (0,)}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def inside(path, roots):
    if isinstance(path, int) or path is None:
        return True
    real = os.path.realpath(os.fsdecode(path))
    return any(real == r or real.startswith(r + os.sep) for r in roots)

def hook(event, args):
    if event in BLOCKED or event.startswith("ctypes."):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event.startswith("socket.") and not NETWORK:
        raise PermissionError(f"sandbox: network access ({event}) is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
        if not inside(path, [SCRATCH] if writing else READ_ROOTS):
            raise PermissionError(f"sandbox: {'writing' if writing else 'reading'} {path} is outside the scratch dir")
    elif event in PATH_EVENTS:
        roots = READ_ROOTS if event in ("os.listdir", "os.scandir") else [SCRATCH]
        for i in PATH_EVENTS[event]:
            if i < len(args) and not inside(args[i], roots):
                raise PermissionError(f"sandbox: {event} on {args[i]} is outside the scratch dir")

code = open(sys.argv[2]).read()
sys.addaudithook(hook)
sys.argv = [sys.argv[2]]
exec(compile(code, "main.py", "exec"), {"__name__": "__main__"})
'''


@dataclass(frozen=True)
class SandboxLimits:
    wall_time_s: float = 10.0
    cpu_time_s: int = 5
    memory_mb: int = 512
    file_size_mb: int = 8
    open_files: int = 64
    max_output_bytes: int = 64 * 1024
    network: bool = False


@dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    limit: Optional[str] = None        # "wall_time" | "cpu_time" | "memory" | "file_size" when one was hit
    network_isolated: bool = False     # the run had no network namespace access (unshare -n)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.limit is None


@functools.lru_cache(maxsize=1)
def network_namespace_command() -> list[str]:
    """The prefix that runs a command in an empty network namespace here, or [] if none works.

    `unshare -n` needs CAP_SYS_ADMIN (root); `unshare -rn` also maps the user to root inside a new
    user namespace, which works unprivileged where user namespaces are enabled. Probed once.
    """
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


def _limit_arg(limits: SandboxLimits) -> str:
    mb = 1024 * 1024
    return f"{limits.cpu_time_s},{limits.memory_mb * mb},{limits.file_size_mb * mb},{limits.open_files}"


def _which_limit(returncode: int, stderr: str, timed_out: bool) -> Optional[str]:
    if timed_out:
        return "wall_time"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_time"
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return "file_size"
    if "MemoryError" in stderr:
        return "memory"
    return None


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a script in a fresh scratch directory under `limits`."""
    scratch = Path(tempfile.mkdtemp(prefix="sao-sandbox-"))
    try:
        return await _run_in(scratch, code, limits)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def _run_in(scratch: Path, code: str, limits: SandboxLimits) -> SandboxResult:
    (scratch / "_guard.py").write_text(GUARD)
    (scratch / "main.py").write_text(code)
    unshare = network_namespace_command() if not limits.network else []
    cmd = unshare + [sys.executable, "-I", str(scratch / "_guard.py"), str(scratch), str(scratch / "main.py"),
                     "1" if limits.network else "0", _limit_arg(limits)]
    with open(scratch / ".stdout", "wb") as out, open(scratch / ".stderr", "wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err, cwd=scratch,
            env={"PATH": "/usr/bin:/bin", "HOME": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"},
            start_new_session=True)
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), limits.wall_time_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            if proc.returncode is None:
                _kill_group(proc.pid)
                await proc.wait()
    stdout = _read_head(scratch / ".stdout", limits.max_output_bytes)
    stderr = _read_head(scratch / ".stderr", limits.max_output_bytes)
    limit = _which_limit(proc.returncode, stderr, timed_out)
    return SandboxResult(proc.returncode, stdout, stderr, limit, bool(unshare))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_head(path: Path, limit: int) -> str:
    with open(path, "rb") as fh:
        return fh.read(limit).decode("utf-8", errors="replace")
