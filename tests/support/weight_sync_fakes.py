"""Fault-injecting engines for weight-sync tests, on top of rollout.weights.loopback_engine.LoopbackEngine:
`dead=True` makes every control call fail like a killed server's refused connection; `hang=True`
makes a bucket receive never return."""
from __future__ import annotations

import asyncio

from rollout.engines.engine import EngineError
from rollout.weights.loopback_engine import LoopbackEngine


class FakeEngine(LoopbackEngine):
    def __init__(self, name: str, dead: bool = False, hang: bool = False):
        super().__init__(name, reply_timeout_s=120.0)
        self.dead, self.hang = dead, hang

    def _note(self, what: str) -> None:
        super()._note(what)
        if self.dead:
            raise EngineError(f"engine {self.name}: POST /{what}: connection refused")

    async def update_weights_from_distributed(self, *args, **kwargs) -> None:
        if self.hang:
            self._note("update_weights_from_distributed")
            await asyncio.Event().wait()
        await super().update_weights_from_distributed(*args, **kwargs)


async def run_then_close(engines, fn):
    """`await fn(engines)`, then close every engine's client (whatever fn did)."""
    try:
        return await fn(engines)
    finally:
        for e in engines:
            await e.close()
