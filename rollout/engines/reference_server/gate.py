"""What stands in front of the scheduler in SGLang's tokenizer manager: the pause flag and the
model-update lock. Both live on the server's event loop.

- Pause (managers/tokenizer_manager.py:777-778, 938-939, 2267-2286): /pause_generation sets the flag
  under a condition; every new /generate (and every /health probe, which is a generate) waits for it
  to clear BEFORE it reaches the scheduler, so while paused new work waits, however long.
- Model-update lock (utils/aio_rwlock.py, tokenizer_manager.py:771): a writer-preferring
  reader/writer lock. Each generate holds a read lock from submission until its reply; a weight
  update that finds the server NOT paused takes the write lock, so it waits for every in-flight
  request to finish, and new requests queue behind it (tokenizer_control_mixin.py:471-484, 503-531;
  tokenizer_manager.py:2288-2318). A paused server updates at once, without the lock.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


class ReadWriteLock:
    """Many readers or one writer; a waiting writer blocks new readers (as SGLang's RWLock)."""

    def __init__(self):
        self._cond = asyncio.Condition()
        self.readers = 0
        self.writer_active = False
        self.waiting_writers = 0

    @contextlib.asynccontextmanager
    async def reader(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not (self.writer_active or self.waiting_writers))
            self.readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self):
        async with self._cond:
            self.waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not (self.writer_active or self.readers))
                self.writer_active = True
            finally:
                self.waiting_writers -= 1
        try:
            yield
        finally:
            async with self._cond:
                self.writer_active = False
                self._cond.notify_all()

    @property
    def locked(self) -> bool:
        return self.writer_active or self.readers > 0


class UpdateGate:
    """The pause flag (with its condition) and the model-update lock of one server."""

    def __init__(self):
        self.paused = False
        self.cond = asyncio.Condition()
        self.lock = ReadWriteLock()
        self.held = 0            # requests waiting for the pause to end (reported by /sao_server_info)

    async def wait_unpaused(self) -> None:
        async with self.cond:
            self.held += 1
            try:
                await self.cond.wait_for(lambda: not self.paused)
            finally:
                self.held -= 1

    async def update(self, fn: Callable[[], Awaitable[T]], hold_pause_lock: bool = True) -> T:
        """Run a weight update as SGLang does: at once while paused (holding the pause condition, so
        /continue_generation cannot race it, unless `hold_pause_lock` is False as for disk updates),
        else under the write lock."""
        async with self.cond:
            paused = self.paused
            if paused and hold_pause_lock:
                return await fn()
        if paused:
            return await fn()
        async with self.lock.writer():
            return await fn()
