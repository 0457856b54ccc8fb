"""The bubblewrap command line that isolates one sandbox run at the OS level.

What the sandboxed process gets (see docs/rollout.md, "Sandbox"):
- its own pid, network, ipc, uts (and cgroup) namespaces: a fresh /proc that shows only its own
  processes (never the trainer's /proc/<pid>/environ), no network but a down loopback;
- an empty environment (bwrap itself is started with a minimal one too, so not even bwrap's
  pid 1 inside holds the trainer's variables) plus PATH, HOME and single-thread math libraries;
- a read-only view of /usr (and the /bin, /lib* links) and the Python installation only: no /etc,
  no home, no project tree; a working dir (/sandbox) and /tmp that are both size-capped tmpfs mounts
  (nothing a run writes reaches the host disk; the file count is checked from outside, sandbox.py);
- a new session (no terminal to inject keystrokes into), SIGKILL when bwrap's parent dies;
- rlimits set by `prlimit` before the interpreter starts: CPU seconds, address space, written-file
  size, processes, open files, no core dumps;
- a seccomp filter (sandbox_seccomp.py, applied by bwrap before the command's exec) that refuses
  namespaces, mounts, ptrace, bpf, keyrings and the like, where libseccomp is installed.

RLIMIT_NPROC is not enforced for root, and a user namespace made by root still maps to root, so when
we are root bwrap runs without a user namespace and the command drops to a fresh unprivileged uid
(`setpriv`, all capabilities gone) picked at random per run: the process limit is then that run's own.
As an ordinary user bwrap makes a user namespace (nested ones disabled) and the process limit is
counted on top of the user's current processes.
"""
from __future__ import annotations

import functools
import json
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from rollout.rewards.sandbox_seccomp import disable, program_fd
from sao_megatron.core.config.errors import ConfigError

SANDBOX_DIR = "/sandbox"
UNSAFE = "unsafe-no-isolation"
FIX = (f'install bubblewrap (apt-get install -y bubblewrap), or set rollout.sandbox = "{UNSAFE}" to run '
       "model-written code without OS isolation")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SANDBOX_DIR, "PYTHONDONTWRITEBYTECODE": "1",
       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LANG": "C.UTF-8"}
# uids the sandbox runs as when we are root: far above any real account, never 65534 (nobody)
UID_BASE, UID_SPAN = 3_000_000, 1_000_000_000


class SandboxUnavailable(ConfigError):
    """The OS isolation the sandbox needs is missing or does not work here: a one-line recipe error
    naming rollout.sandbox, raised before any untrusted code runs."""

    def __init__(self, problem: str):
        super().__init__("rollout.sandbox", problem, FIX)


def is_root() -> bool:
    return os.geteuid() == 0


def pick_uid() -> Optional[int]:
    """A fresh unprivileged uid for one run when we are root (its process count is that run's alone)."""
    return UID_BASE + secrets.randbelow(UID_SPAN) if is_root() else None


def _python_roots() -> list[str]:
    """The directories the interpreter needs (venv and base install), outside /usr, outermost only."""
    roots = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    roots += [os.path.dirname(os.path.realpath(sys.executable))]
    kept: list[str] = []
    for root in sorted(set(roots)):
        if root == "/usr" or root.startswith("/usr/"):
            continue
        if not any(root == k or root.startswith(k + os.sep) for k in kept):
            kept.append(root)
    return kept


def _system_mounts() -> list[str]:
    """/usr read-only; /bin, /sbin, /lib* as the same links (merged /usr) or read-only binds."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    return args


def _readonly_binds(roots: list[str]) -> list[str]:
    """Read-only binds of `roots` with their parent dirs made 0755 (bwrap would make them 0700,
    which an unprivileged uid cannot walk through)."""
    args: list[str] = []
    made: set[str] = {"/", "/tmp"}   # /tmp is the private tmpfs (1777), mounted before these binds
    for root in roots:
        for parent in reversed(Path(root).parents):
            if str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", root, root]
    return args


def _namespaces(network: bool) -> list[str]:
    if is_root():   # no user namespace: it would map the sandbox to root, where RLIMIT_NPROC is not enforced
        args = ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        args += [] if network else ["--unshare-net"]
        return args + ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    args = ["--unshare-all", "--unshare-user", "--disable-userns"]
    return args + (["--share-net"] if network else [])


def user_process_count() -> int:
    """Processes (threads included, as RLIMIT_NPROC counts them) of this uid now."""
    uid, count = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return count


def rlimit_args(cpu_s: int, as_bytes: int, fsize_bytes: int, nofile: int, nproc: int) -> list[str]:
    """`prlimit` options; the CPU hard limit one second above the soft one (SIGXCPU, then SIGKILL)."""
    return ["prlimit", f"--cpu={cpu_s}:{cpu_s + 1}", f"--as={as_bytes}", f"--fsize={fsize_bytes}",
            f"--nofile={nofile}", f"--nproc={nproc}", "--core=0", "--"]


def bwrap_command(argv: list[str], *, uid: Optional[int], limits: list[str], network: bool, tmp_bytes: int,
                  work_bytes: int, file_fds: Sequence[tuple[int, str]] = (), info_fd: Optional[int] = None,
                  seccomp_fd: Optional[int] = None) -> list[str]:
    """The full command: bwrap, then (as root) setpriv to `uid`, then prlimit `limits`, then `argv`;
    bwrap applies the seccomp program read from `seccomp_fd` (sandbox_seccomp.py) to all of it.
    The working dir is a tmpfs of `work_bytes` (no byte of it reaches the host disk), filled with
    the (fd, name) pairs of `file_fds` by bwrap itself (--file copies each fd's content)."""
    args = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--new-session", "--clearenv"]
    args += ["--info-fd", str(info_fd)] if info_fd is not None else []
    args += ["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []
    args += _namespaces(network) + _system_mounts()
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    # after the private /tmp: an interpreter installed under /tmp (a venv in a checkout there) stays visible
    args += _readonly_binds(_python_roots())
    # 0777: the run's uid (as root, a fresh one) owns nothing here, yet must create and delete files
    args += ["--perms", "0777", "--size", str(work_bytes), "--tmpfs", SANDBOX_DIR]
    for fd, name in file_fds:
        args += ["--perms", "0644", "--file", str(fd), f"{SANDBOX_DIR}/{name}"]
    args += ["--chdir", SANDBOX_DIR]
    for key, value in ENV.items():
        args += ["--setenv", key, value]
    args.append("--")
    if uid is not None:
        args += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all", "--"]
    return args + limits + argv


def nproc_for(limit: int) -> int:
    """RLIMIT_NPROC for a run: its own count as root (fresh uid), else on top of this user's processes."""
    return limit if is_root() else user_process_count() + limit


@functools.lru_cache(maxsize=1)
def bwrap_problem() -> Optional[str]:
    """None when bwrap isolates here, else the one-line reason (probed once per process). The probe
    runs with the seccomp filter every run gets; if only the filter stops bwrap (a kernel without
    seccomp filters), runs go ahead without it and the log and SandboxResult.seccomp say so."""
    missing = [tool for tool in ("bwrap", "prlimit") + (("setpriv",) if is_root() else ()) if not shutil.which(tool)]
    if missing:
        return f"{', '.join(missing)} not found, so model-written code cannot be isolated"
    seccomp_fd = program_fd()
    problem = _probe(seccomp_fd)
    if problem and seccomp_fd is not None and _probe(None) is None:
        disable(f"bwrap could not load it here ({problem})")
        return None
    return problem


def _probe(seccomp_fd: Optional[int]) -> Optional[str]:
    """Run /usr/bin/true in a sandbox (closing `seccomp_fd`): None when it worked, else why not."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory(prefix="sao-sandbox-probe-") as tmp:
            cmd = bwrap_command(["/usr/bin/true"], uid=pick_uid(), network=False, tmp_bytes=1 << 20, work_bytes=1 << 20,
                                limits=rlimit_args(5, 1 << 30, 1 << 20, 64, nproc_for(8)), seccomp_fd=seccomp_fd)
            proc = subprocess.run(cmd, capture_output=True, timeout=60, env=ENV, stdin=subprocess.DEVNULL,
                                  pass_fds=() if seccomp_fd is None else (seccomp_fd,), cwd=tmp)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap did not run ({exc})"
    finally:
        if seccomp_fd is not None:
            os.close(seccomp_fd)
    if proc.returncode != 0:
        err = (proc.stderr.decode(errors="replace").strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return f"bwrap cannot create the sandbox here ({err})"
    return None


def require_bwrap() -> None:
    """Raise SandboxUnavailable (one line naming rollout.sandbox) unless bwrap isolates here."""
    problem = bwrap_problem()
    if problem:
        raise SandboxUnavailable(problem)


class NamespaceInit:
    """bwrap's pid 1 inside the sandbox, held by a pidfd (no pid-reuse race).

    bwrap reports the command's exit as soon as it happens, while its pid 1 may still be taking the
    rest of the namespace down; pid 1 exits only once every process in its namespace is gone. So the
    end of a run waits for this pidfd, and killing pid 1 is how the whole namespace is killed.
    """

    def __init__(self, read_fd: int):
        self.read_fd = read_fd
        self.pidfd: Optional[int] = None
        self.child_pid = 0

    def learn(self) -> None:
        """Blocking: read bwrap's --info-fd JSON (EOF when bwrap closes it) and open a pidfd on pid 1."""
        data = b""
        with os.fdopen(self.read_fd, "rb") as fh:
            for chunk in iter(lambda: fh.read1(4096), b""):
                data += chunk
        try:
            self.child_pid = int(json.loads(data)["child-pid"])
            self.pidfd = os.pidfd_open(self.child_pid)
        except (ValueError, KeyError, ProcessLookupError):
            self.pidfd = None       # bwrap failed before starting it, or it is gone already (reaped)

    def files_used(self) -> Optional[int]:
        """Inodes in use in the run's two tmpfs mounts (working dir and /tmp), read through pid 1's root;
        None when that is not readable (pid 1 gone, or not yet known)."""
        if self.pidfd is None:
            return None
        try:
            stats = [os.statvfs(f"/proc/{self.child_pid}/root{mount}") for mount in (SANDBOX_DIR, "/tmp")]
        except OSError:
            return None
        return sum(st.f_files - st.f_ffree for st in stats)

    def kill(self) -> None:
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait_gone(self, timeout_s: float) -> bool:
        """Blocking: True once pid 1 (and so every process of the namespace) has exited."""
        return self.pidfd is None or bool(select.select([self.pidfd], [], [], timeout_s)[0])

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def mib(n: float) -> int:
    return int(math.ceil(n * 1024 * 1024))
