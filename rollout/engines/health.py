"""The rollout driver's view of its engines' health: pick the least-loaded live engine, mark one dead
when a call fails (aborting the request it held), and bring dead engines back when /health passes.

`EngineHealth` is a part of `RolloutDriver` (rollout/driver.py), split out by concern; it works on the
driver's state: ``engines`` {name: Generator}, ``_load`` {name: requests in flight}, ``_dead`` (names),
``_versions`` {name: weight version}, ``_update_lock`` (held through a weight update), ``counts``,
``_error`` and ``_progress`` (how a failure reaches get_batch), and the timing settings
``probe_interval_s``, ``control_timeout_s``, ``stall_timeout_s``, ``engine_down_timeout_s``, the
generate calls in flight per engine ``_calls`` and when each engine last answered ``_answered``, and the
restart bookkeeping ``_restarting`` (names being started again: the all-down clock waits for them)
and ``_awaiting_weights`` (restarted after the first weight update: kept out until an update gives
them the current version, so no request runs on the initial weights).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time

from rollout.engines.engine import EngineError, Generator

log = logging.getLogger("rollout.driver")

ENGINE_FAILURES = (EngineError, asyncio.TimeoutError, OSError)


class DriverError(RuntimeError):
    """The rollout driver cannot make progress (all engines down, a worker crashed, a stall)."""


def rejected(exc: BaseException) -> bool:
    """The engine refused the request itself (HTTP 400/422: a value out of range, a prompt too long),
    as SGLangEngine words it; not a sign that the engine is down, and not worth a retry."""
    return isinstance(exc, EngineError) and re.search(r"answered HTTP (400|422)\b", str(exc)) is not None


class EngineSilent(EngineError):
    """The liveness watch took the engine for dead while this call waited on it."""


class EngineHealth:
    async def _generate_on(self, engine: Generator, request):
        """One generate call, registered so the liveness watch can end it if the engine goes silent."""
        call = asyncio.ensure_future(engine.generate(request))
        self._calls[engine.name].add(call)
        try:
            result = await asyncio.wait_for(asyncio.shield(call), self.cfg.request_timeout_s)
        except asyncio.CancelledError:
            if call.cancelled() and not asyncio.current_task().cancelling():   # ended by _watch_live
                raise EngineSilent(f"engine {engine.name}: no answer and /health failing for "
                                   f"{self.engine_down_timeout_s:.0f}s (rollout.engine_down_timeout_s)") from None
            call.cancel()
            raise
        except asyncio.TimeoutError:
            call.cancel()
            raise
        finally:
            self._calls[engine.name].discard(call)
        self._answered[engine.name] = time.monotonic()
        return result

    async def _pick_engine(self) -> Generator:
        """The least-loaded live engine; waits for a revival, fails after engine_down_timeout_s."""
        deadline = time.monotonic() + self.engine_down_timeout_s
        while True:
            live = [n for n in self.engines if n not in self._dead]
            if live:
                return self.engines[min(live, key=lambda n: self._load[n])]
            if time.monotonic() > deadline and not self._restarting:
                if self._error is None:
                    self._error = DriverError(self._down_message())
                self._progress.set()
                raise DriverError(str(self._error))
            await asyncio.sleep(self.probe_interval_s)

    async def _engine_failed(self, engine: Generator, rid: str, reason: str) -> None:
        self.counts["engine_errors"] += 1
        if engine.name not in self._dead:
            log.warning("engine %s failed (%s); retrying its requests elsewhere", engine.name, reason)
        self._dead.add(engine.name)
        with contextlib.suppress(*ENGINE_FAILURES):   # best effort: the engine may be gone
            await asyncio.wait_for(engine.abort(rid), min(self.control_timeout_s, 5.0))

    def engine_restarting(self, name: str) -> None:
        """A supervisor is starting engine `name` again (trainer/engines.py): it is dead meanwhile."""
        self._dead.add(name)
        self._restarting.add(name)

    def engine_restarted(self, name: str, ok: bool) -> None:
        """The restart ended. A new process serves the initial weights: after the first weight update
        it waits for the next update before the probe may bring it back."""
        self._restarting.discard(name)
        if ok and max(self._versions.values()) > 0:
            self._awaiting_weights.add(name)

    async def _catch_up(self, version) -> None:
        """After a weight update: engines restarted meanwhile that now serve `version` may come back."""
        for name in sorted(self._awaiting_weights if version is not None else ()):
            engine = self.engines[name]
            with contextlib.suppress(*ENGINE_FAILURES):
                if await asyncio.wait_for(engine.weight_version(), self.control_timeout_s) == version:
                    self._awaiting_weights.discard(name)

    async def _watch_live(self) -> None:
        """Live engines with requests in flight must keep answering: one whose calls all wait, that
        answered nothing and failed /health for engine_down_timeout_s, is taken for dead and its calls
        end (their samples retry elsewhere under new ids). A merely slow engine still answers /health."""
        interval = max(self.probe_interval_s, self.engine_down_timeout_s / 4)
        silent_since: dict[str, float] = {}
        while self._running:
            await asyncio.sleep(interval)
            if self._update_lock.locked():   # paused engines answer nothing, by design
                silent_since.clear()
                continue
            now = time.monotonic()
            for name in sorted(set(self.engines) - self._dead):
                busy = bool(self._calls[name]) and now - self._answered[name] > interval
                if not busy or await self._healthy(self.engines[name], interval):
                    silent_since.pop(name, None)
                    continue
                if now - silent_since.setdefault(name, now) >= self.engine_down_timeout_s:
                    silent_since.pop(name)
                    self._take_for_dead(name)

    async def _healthy(self, engine: Generator, timeout_s: float) -> bool:
        try:
            return bool(await asyncio.wait_for(engine.health(), timeout_s))
        except ENGINE_FAILURES:
            return False

    def _take_for_dead(self, name: str) -> None:
        log.warning("engine %s answers nothing and fails /health for %.0fs; re-issuing its requests",
                    name, self.engine_down_timeout_s)
        self._dead.add(name)
        for call in list(self._calls[name]):
            call.cancel()

    async def _probe_loop(self) -> None:
        while self._running:
            await asyncio.sleep(self.probe_interval_s)
            if self._update_lock.locked():   # /health generates: it would wait on a paused engine
                continue
            for name in sorted(self._dead - self._restarting - self._awaiting_weights):
                engine = self.engines[name]
                try:
                    healthy = await asyncio.wait_for(engine.health(), self.probe_interval_s * 5)
                    if healthy:
                        self._versions[name] = await asyncio.wait_for(engine.weight_version(), self.control_timeout_s)
                except ENGINE_FAILURES:
                    healthy = False
                if healthy:
                    log.info("engine %s is healthy again", name)
                    self._dead.discard(name)
            self._fill()

    async def _control(self, engine: Generator, coro):
        """A control call (pause/resume/version) with a timeout; failure names the engine."""
        try:
            return await asyncio.wait_for(coro, self.control_timeout_s)
        except ENGINE_FAILURES as exc:
            raise DriverError(f"engine {engine.name}: control call failed ({type(exc).__name__}: {exc}); "
                              "is the server up?") from exc

    def _down_message(self) -> str:
        return (f"all engines are down ({sorted(self.engines)}) for {self.engine_down_timeout_s:.0f}s "
                "(rollout.engine_down_timeout_s); check the servers and their logs")

    def _stall_message(self) -> str:
        if len(self._dead) == len(self.engines):
            return self._down_message()
        return (f"no sample finished for {self.stall_timeout_s:.0f}s: {len(self._active)} in flight, "
                f"load {self._load}, dead engines {sorted(self._dead)}, buffer {self.buffer.num_ready} ready")
