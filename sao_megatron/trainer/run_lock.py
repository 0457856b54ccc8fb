"""One writer per run directory: an exclusive `flock` on `<run dir>/.sao.lock`, held for the whole life of
the process that took it.

The kernel drops a flock when its holder dies (SIGKILL, OOM, a node reboot on a local disk), so a dead
run never blocks the next one; the file also holds the holder's pid, written after the lock is taken and
truncated on a clean exit, so a pid still there when the lock is free says the previous run died: the
new run takes over and says so in one line. Several ranks: only the process that launches them (or
rank 0 under srun/mpirun) takes it (entry.train_from_recipe).

flock on NFS (Linux >= 2.6.12) is emulated with POSIX byte-range locks, which the server arbitrates;
on a filesystem without locking the flock call fails and the run says so rather than run unguarded.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import os
import sys
from pathlib import Path

from sao_megatron.core.config import ConfigError

LOCK_NAME = ".sao.lock"
_held: dict[Path, int] = {}   # run dir -> open fd; the lock lives as long as the fd (this process)


def lock_run_dir(run_dir: Path) -> None:
    """Take `run_dir`'s lock for this process, or refuse (ConfigError: one line, exit 2) while a live
    process holds it. Call before anything is written into the run dir: a refused run touches nothing."""
    run_dir = Path(run_dir)
    if run_dir in _held:
        return
    path = run_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError("run.output_dir", f"cannot create the run lock {path}: {err.strerror}",
                          "choose a writable run.output_dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = _read_pid(fd)
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            who = f"pid {holder}" if holder else "another process"
            raise ConfigError("run.name", f"run directory {run_dir} is in use by a live run ({who})",
                              "wait for it to end, or give this run another run.name") from None
        raise ConfigError("run.output_dir", f"cannot lock {path}: {err.strerror}",
                          "put run.output_dir on a filesystem with file locking") from None
    previous = _read_pid(fd)
    if previous and previous != os.getpid():
        print(f"run directory {run_dir}: taking over the lock of pid {previous}, which ended without "
              "releasing it", file=sys.stderr)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[run_dir] = fd
    if len(_held) == 1:
        atexit.register(release_all)


def release_all() -> None:
    """A clean exit: empty the pid (the next run then has nothing to take over) and drop every lock."""
    for run_dir, fd in list(_held.items()):
        try:
            os.ftruncate(fd, 0)
        except OSError:   # the disk went away: the kernel still drops the flock with the fd
            pass
        os.close(fd)
        del _held[run_dir]


def _read_pid(fd: int) -> int:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0
