"""How a run stops while it waits for samples: a preemption signal or a rollout failure during
collection, told to every rank at the point where they wait for rank 0's batch.

Collection can take as long as the engines do (a step of a 750B run waits minutes for its samples;
engines that reject everything wait forever without the driver's failure budget). The loop's own
safe point (between steps) is not enough: `collect_until_stopped` polls the preemption flag while rank 0
waits, and `share_batch` carries either the batch or a `Stop` to the other ranks, so all of them leave
the same collection together and can save the same checkpoint (a collective) before exiting.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Awaitable, Optional

POLL_S = 0.2   # how often rank 0 looks at the preemption flag while it waits for samples


@dataclass
class Stop:
    """Why collection ended without a batch: a signal (preempted) or a rollout error (its one line)."""

    reason: str
    preempted: bool


class CollectionStopped(Exception):
    """Raised on every rank when collection ended with a `Stop`; the loop saves and exits."""

    def __init__(self, stop: Stop):
        super().__init__(stop.reason)
        self.stop = stop


def preemption_flag() -> bool:
    """This rank's preemption flag (no collective: only rank 0 polls it, alone, while it waits)."""
    from checkpoints.preemption import should_checkpoint_and_exit

    return should_checkpoint_and_exit(sync=False)


async def collect_until_stopped(batch: Awaitable) -> list | Stop:
    """The batch, or a `Stop` once a preemption signal arrives or the sample source fails.

    A failure of the sample source (rollout.driver.DriverError: all engines down, every sample
    failing) becomes a Stop carrying its one line; any other exception is a bug and propagates (with
    several ranks the loop sends it on as a Stop naming rank 0, so the others leave share_batch too).
    """
    from rollout.engines.health import DriverError

    task = asyncio.ensure_future(batch)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if preemption_flag():
                signals = ", ".join(_received())
                return Stop(f"{signals} during collection", preempted=True)
    except DriverError as err:
        return Stop(str(err), preempted=False)
    finally:
        await _cancel(task)


def share_batch(batch: Optional[list | Stop], world_size: int):
    """Rank 0's batch (or Stop) on every rank; a Stop raises CollectionStopped everywhere."""
    if world_size > 1:
        import torch.distributed as dist

        box = [batch]
        dist.broadcast_object_list(box, src=0)
        batch = box[0]
    if isinstance(batch, Stop):
        raise CollectionStopped(batch)
    return batch


def _received() -> list[str]:
    from checkpoints.preemption import received_signals

    return received_signals() or ["a preemption request"]


async def _cancel(task: asyncio.Future) -> None:
    """Cancel the pending get_batch (it takes nothing from the buffer until it returns)."""
    if task.done():
        if not task.cancelled():
            task.exception()   # retrieved, so asyncio does not log it again
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
