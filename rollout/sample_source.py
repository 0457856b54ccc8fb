"""The one interface the trainer gets samples through: `SampleSource`.

`RolloutDriver` (rollout/driver.py) generates them on the engines; `SavedRollouts` (rollout/dump.py)
replays a rollout-only run's saved steps (run.debug = train-only); `DumpingSource` saves what another
source hands out (run.debug = rollout-only). The trainer starts the source after a resume, asks it
for one batch per step, logs its metrics, checkpoints its state, and stops it at the end.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from sao_megatron.core.records import Sample


@runtime_checkable
class SampleSource(Protocol):
    async def start(self) -> None:
        """Begin producing (the driver starts its request loop); called once, after a resume."""

    async def stop(self) -> None:
        """Stop producing and release what start() took; safe when start() never ran."""

    async def get_batch(self, num_samples: int, current_version: int) -> list[Sample]:
        """The next `num_samples` finished samples for a trainer whose policy is `current_version`."""

    def metrics(self) -> dict:
        """rollout/* numbers about the source itself (throughput, buffer, drops), merged into each log line."""

    def state_dict(self) -> dict:
        """What a resume needs to continue where the run stopped (a checkpoint component)."""

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict()."""
