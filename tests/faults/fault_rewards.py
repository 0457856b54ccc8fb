"""Rewards for the trainer fault tests, importable by a `sao train` subprocess (rollout.reward_fn)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path


async def hang_after_marking(sample) -> float:
    """Marks $SAO_FAULT_MARKER (collection has begun, handlers are installed), then never returns."""
    Path(os.environ["SAO_FAULT_MARKER"]).touch()
    await asyncio.sleep(3600)
    return 0.0


def always_raise(sample) -> float:
    raise RuntimeError("the reward service is down")
