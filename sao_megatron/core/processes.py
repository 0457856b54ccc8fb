"""Processes that must not outlive what they serve: `pid_alive` for watchdogs, and a reaper that kills
everything a run started once the run's top process is gone, SIGKILL included.

Why a reaper and not PR_SET_PDEATHSIG alone: the death signal is set by a child on itself and covers
one generation. A run's descendants include processes we do not start (Megatron's checkpoint writer
starts a multiprocessing Manager through the spawn context; the spawn resource tracker; torchrun's
ranks), and once their parent dies they are re-parented to init, where no parent link finds them. So
the run's top process puts a token in its environment, which every descendant inherits through fork
and exec, and starts a watcher outside its session; when the top process exits for any reason the
watcher kills every process whose environment holds the token. A process that clears its
environment (the reward sandbox) is out of reach here and kills its own process group instead.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from typing import Iterator, Sequence

REAP_ENV = "SAO_REAP_TOKEN"


def pid_alive(pid: int) -> bool:
    """True while `pid` exists. A process owned by another user (PermissionError) still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_descendants_at_exit() -> bool:
    """Start the watcher for this process (once per tree: a descendant that calls it again finds the
    token already set). Returns whether a watcher was started. Linux only (reads /proc)."""
    if os.environ.get(REAP_ENV) or not os.path.isdir("/proc/self"):
        return False
    token = f"{os.getpid()}-{os.urandom(8).hex()}"
    env = {k: v for k, v in os.environ.items() if k != REAP_ENV}   # the watcher must not kill itself
    subprocess.Popen([sys.executable, "-m", "sao_megatron.core.processes", str(os.getpid()), token], env=env,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, close_fds=True)
    os.environ[REAP_ENV] = token
    return True


def children_of(pid: int) -> list[int]:
    """The direct children of `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(entry))
    return found


@contextlib.contextmanager
def forward_signals_to_children(pid: int, signals: Sequence[int]) -> Iterator[None]:
    """While inside, `signals` reaching this process go to the children of `pid` instead.

    For a launcher (torchrun, mpirun) whose children are the ranks: each rank handles a preemption
    signal itself (save, exit 0), where torchrun would kill its workers on SIGTERM after 30 s and
    die at once on SIGUSR1. Main thread only (Python's signal rule)."""
    def forward(signum, frame) -> None:
        for child in children_of(pid):
            with contextlib.suppress(OSError):
                os.kill(child, signum)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def token_holders(token: str) -> list[int]:
    """Pids (not this one) whose environment carries the token."""
    needle = f"{REAP_ENV}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:   # gone meanwhile, or a zombie
            continue
    return found


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):   # no pidfd (old kernel) or already gone
        while pid_alive(pid):
            time.sleep(0.5)
        return
    select.select([fd], [], [])
    os.close(fd)


def _reap(pid: int, token: str) -> None:
    _wait_for_exit(pid)
    for _ in range(10):   # again, in case one was forking while we looked
        victims = token_holders(token)
        if not victims:
            return
        for victim in victims:
            try:
                os.kill(victim, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)


if __name__ == "__main__":
    _reap(int(sys.argv[1]), sys.argv[2])
