"""Locally started engines whose process exits are started again (rollout.engine_restarts).

Same port and key, so their clients keep working; at most rollout.engine_restarts times per run, all
engines together. Meanwhile the driver retries the dead engine's requests (new request ids, the old
ones aborted: nothing lost or duplicated) and counts the restart as time the engines may be down; a
restarted engine serves again once it holds the current weights (rollout/engines/health.py). A weight
update waits for a restart in progress (`settled`) and tells every rank how many `restarts` there
were; after a new one every sender (each pipeline stage's too) forms its group again, since the new
process is in none of the old ones (weight_updates.py `_regroup_after_restarts`). Past the budget
the engine stays dead: the run continues on the others, or stops after
rollout.engine_down_timeout_s when none is left. Engines at rollout.engine_urls belong to someone
else and are never restarted here.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from sao_megatron.core.config import Recipe

from .engines import launch_engine

log = logging.getLogger(__name__)


class EngineRestarts:
    POLL_S = 1.0

    def __init__(self, recipe: Recipe, engines: list, handles: list, driver, run_dir: Path):
        self.recipe, self.driver, self.run_dir = recipe, driver, run_dir
        self.slots = {e.name: (index, handle) for index, (e, handle) in enumerate(zip(engines, handles))}
        self.api_keys = {e.name: e.api_key for e in engines}
        self.left = recipe.rollout.engine_restarts
        self.restarts: list[str] = []          # engine names, in restart order
        self.settled = asyncio.Event()
        self.settled.set()
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="engine-restarts")

    async def stop(self) -> None:
        """Stop watching, then stop every engine process (the restarted ones included)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for _, handle in self.slots.values():
            handle.stop()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.POLL_S)
            for name, (index, handle) in list(self.slots.items()):
                if handle.process.poll() is not None and self.left > 0:
                    await self._restart(name, index, handle)

    async def _restart(self, name: str, index: int, old) -> None:
        self.left -= 1
        self.settled.clear()
        self.driver.engine_restarting(name)
        log.warning("engine %s exited with code %s; restarting it (%d restarts left)", name,
                    old.process.returncode, self.left)
        ok = False
        try:
            await asyncio.to_thread(old.stop)   # what the dead server forked may still hold the GPU and port
            port = urlsplit(old.url).port
            handle = await asyncio.to_thread(launch_engine, self.recipe, index, self.api_keys[name],
                                             self.run_dir, port)
            self.slots[name] = (index, handle)
            self.restarts.append(name)   # the next weight update regroups every sender (weight_updates.py)
            ok = True
        except Exception as err:   # noqa: BLE001 - the engine stays dead; the driver reports it in time
            log.error("engine %s could not be restarted: %s", name, str(err).splitlines()[0] if str(err) else err)
        finally:
            self.driver.engine_restarted(name, ok)
            self.settled.set()
