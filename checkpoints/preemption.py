"""Preemption: SIGTERM / SIGUSR1 (slurm sends SIGUSR1 `signal_seconds` before the time limit with
`--signal=B:USR1@N`, SIGTERM on cancel/preempt) and SIGINT (Ctrl-C, treated as SIGTERM) set a flag;
the trainer polls `should_checkpoint_and_exit()` at safe points (between steps, never inside a collective, and on rank
0 while it waits for samples: sao_megatron/trainer/stopping.py), saves a checkpoint of the last
completed step and exits 0. The handler does nothing else: signal handlers interrupt arbitrary
code, so the checkpoint itself must not run inside one.

Multi-rank: a signal may reach only some ranks; `should_checkpoint_and_exit(sync=True)` all-reduces
the flag (MAX, over `group` or the default group) so every rank decides the same at the same safe
point. Every rank must then call it at the same point; the default (sync=False) reads only this rank.

A second signal (Ctrl-C pressed again, or slurm's SIGTERM at the time limit after its USR1) exits the
process at once with one line and status 128 + the signal: whoever sends it does not want to wait for
the save. The checkpoint being written then is a `.tmp-step_*` directory, never `latest` (run_state.py).
"""
from __future__ import annotations

import os
import signal
import threading

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_requested = threading.Event()
_received: list[str] = []
_signalled: list[str] = []   # signals only (not request_checkpoint_and_exit): the second one exits


def _handler(signum, frame) -> None:
    name = signal.Signals(signum).name
    if _signalled:
        # os.write, not print: a handler may interrupt a write to sys.stderr (reentrant call)
        os.write(2, f"second signal ({name} after {_signalled[0]}): exiting now without saving; the last "
                    f"complete checkpoint stands\n".encode())
        os._exit(128 + signum)
    _signalled.append(name)
    _received.append(name)
    _requested.set()


def install_preemption_handlers(signals=DEFAULT_SIGNALS) -> None:
    """Install the flag-setting handler (main thread only, as Python requires)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_preemption_handlers must run in the main thread (Python signal rule)")
    for sig in signals:
        signal.signal(sig, _handler)


def should_checkpoint_and_exit(sync: bool = False, group=None) -> bool:
    """True once a preemption signal arrived on this rank (sync=False) or on any rank (sync=True)."""
    local = _requested.is_set()
    if not sync:
        return local
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return local
    import torch

    flag = torch.tensor([1 if local else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def received_signals() -> list[str]:
    return list(_received)


def request_checkpoint_and_exit(reason: str = "requested") -> None:
    """Set the flag from code (tests, a watchdog)."""
    _received.append(reason)
    _requested.set()


def clear() -> None:
    _requested.clear()
    _received.clear()
    _signalled.clear()
