"""Calls to several engines at once for weight sync: labelled, under one timeout, failures named.

`run_all` awaits labelled calls together and raises `PushError` (an EngineError) naming the first that
failed, or every one still waiting at the timeout, with their labels in `parties`. An engine that refuses
at once (HTTP 400: no session, a wrong name) therefore fails the step at once, even while the sender's
side of a broadcast is still blocked: that blocking collective runs in a daemon thread
(`in_daemon_thread`) that nobody waits for.
`pinned` runs a function in a worker thread on an explicit CUDA device, because the current CUDA
device is per thread and a new thread starts on cuda:0.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Awaitable

import torch

from rollout.engines.engine import EngineError


async def run_all(calls: dict[str, Awaitable], what: str, timeout_s: float) -> list:
    """Await labelled calls together; the first failure or the timeout raises EngineError naming who."""
    if not calls:
        return []
    tasks = {asyncio.ensure_future(aw): label for label, aw in calls.items()}
    done, pending = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
    failed = [t for t in done if t.exception() is not None]
    for t in pending:
        t.cancel()
    if failed:
        label, err = tasks[failed[0]], failed[0].exception()
        raise PushError(f"{label}: {what} failed: {type(err).__name__}: {err}", [label]) from err
    if pending:
        labels = sorted(tasks[t] for t in pending)
        raise PushError(f"{', '.join(labels)}: {what} did not finish within {timeout_s:.0f}s (dead or hung engine?)",
                         labels)
    return [t.result() for t in tasks]


class PushError(EngineError):
    """A step of a weight update failed or timed out; `parties` are the labels of run_all's calls that
    failed or were still waiting, so a caller can tell a dead engine from its own sender's failure."""

    def __init__(self, message: str, parties: list[str]):
        super().__init__(message)
        self.parties = list(parties)


def in_daemon_thread(fn, *args) -> asyncio.Future:
    """Run a blocking collective off the event loop in a daemon thread. Unlike asyncio.to_thread, a
    collective stuck on a dead peer (it ends at the group timeout) never delays the loop's or the
    interpreter's shutdown; its outcome still reaches the awaiting coroutine."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def deliver(setter, value):
        if not future.done():
            setter(value)

    def work():
        try:
            result = fn(*args)
            outcome = (future.set_result, result)
        except BaseException as err:  # noqa: BLE001 - re-raised in the awaiting coroutine
            outcome = (future.set_exception, err)
        if not loop.is_closed():
            loop.call_soon_threadsafe(deliver, *outcome)

    threading.Thread(target=work, daemon=True, name=f"weight-sync-{getattr(fn, '__name__', 'call')}").start()
    return future


class SerialThread:
    """One daemon thread that runs blocking calls in the order submitted (a push's broadcasts, back to back,
    with no thread start or event-loop turn between two); `submit` returns a future of the call's outcome.
    Once a call fails, or its future was cancelled, the calls queued after it fail without running: the
    collectives after a broken one would meet the peers' next calls. Daemon, as `in_daemon_thread`."""

    def __init__(self, name: str):
        self._loop = asyncio.get_running_loop()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name=name).start()

    def submit(self, fn, *args) -> asyncio.Future:
        future = self._loop.create_future()
        self._queue.put((future, fn, args))
        return future

    def close(self) -> None:
        """The thread ends after the calls already submitted."""
        self._queue.put(None)

    def _serve(self) -> None:
        broken = None
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if broken is None and future.cancelled():
                broken = "its call was cancelled"
            if broken is not None:
                outcome = (future.set_exception, RuntimeError(f"not run: an earlier call in this thread failed "
                                                              f"({broken})"))
            else:
                try:
                    outcome = (future.set_result, fn(*args))
                except BaseException as err:  # noqa: BLE001 - re-raised in the awaiting coroutine
                    broken, outcome = f"{type(err).__name__}: {err}", (future.set_exception, err)
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(_settle, future, *outcome)


def _settle(future: asyncio.Future, setter, value) -> None:
    if not future.done():
        setter(value)


def payload_device(backend: str) -> torch.device:
    """Where the sender's payload lives: the calling thread's current CUDA device for nccl (captured
    here, in the trainer's thread, where the launcher set it to the local rank), else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pin_thread(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device (a no-op for the CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def pinned(device: torch.device, fn, *args):
    """fn(*args) in this worker thread with `device` current: a plain "cuda" allocation, a kernel
    launch or an NCCL call there then uses the local rank's GPU, not cuda:0."""
    pin_thread(device)
    return fn(*args)
