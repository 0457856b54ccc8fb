"""Debug modes: save rollouts without training (rollout-only), train from saved rollouts (train-only).

Layout: ``<dir>/step_<NNNNNN>.jsonl``, one `Sample.to_dict()` per line, one file per trainer step,
written to a temporary name and renamed so a crash never leaves a half file.

`DumpingSource` writes every batch another `SampleSource` hands out (run.debug = rollout-only), and
`SavedRollouts` replays such a directory as a `SampleSource` (rollout/sample_source.py), so
``run.debug = "train-only"`` only swaps the source. Samples stream across files in step order;
a batch may span two files when the batch size differs from the one saved. Staleness is not
re-applied (the samples keep the versions they were generated with).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from sao_megatron.core.records import Sample

from .batch_metrics import batch_metrics
from .sample_source import SampleSource


class RolloutDumper:
    def __init__(self, out_dir: str | Path):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, samples: list[Sample]) -> Path:
        path = self.out_dir / f"step_{step:06d}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        with tmp.open("w") as fh:
            for sample in samples:
                fh.write(json.dumps(sample.to_dict()) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return path


def saved_steps(in_dir: str | Path) -> list[Path]:
    root = Path(in_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"run.debug_dir {root} is not a directory of saved rollouts; "
                                "run with run.debug='rollout-only' first")
    files = sorted(root.glob("step_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"run.debug_dir {root} has no step_*.jsonl files; is it a rollout-only dump?")
    return files


def load_step(path: Path) -> list[Sample]:
    samples = []
    with path.open() as fh:
        for line_no, line in enumerate(fh, start=1):
            try:
                samples.append(Sample.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: not a saved Sample ({exc})") from exc
    return samples


class DumpingSource(SampleSource):
    """`source`, with every batch it hands out saved as the next step file (rollout-only mode)."""

    def __init__(self, source: SampleSource, out_dir: str | Path):
        self.source, self.dumper, self.batches = source, RolloutDumper(out_dir), 0

    async def start(self) -> None:
        await self.source.start()

    async def stop(self) -> None:
        await self.source.stop()

    async def get_batch(self, num_samples: int, current_version: int) -> list[Sample]:
        samples = await self.source.get_batch(num_samples, current_version)
        self.dumper.write(self.batches, samples)
        self.batches += 1
        return samples

    def metrics(self) -> dict:
        return self.source.metrics()

    def state_dict(self) -> dict:
        return self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)


class SavedRollouts(SampleSource):
    """Saved samples, in the order they were saved (train-only mode)."""

    def __init__(self, in_dir: str | Path):
        self.files = saved_steps(in_dir)
        self.file_index, self.offset = 0, 0
        self._current: Optional[list[Sample]] = None
        self._last: list[Sample] = []
        self._version = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def get_batch(self, num_samples: int, current_version: int) -> list[Sample]:
        batch: list[Sample] = []
        while len(batch) < num_samples:
            if self.file_index >= len(self.files):
                raise EOFError(f"saved rollouts exhausted after {len(self.files)} steps; lower run.num_steps "
                               "or save more steps")
            if self._current is None:
                self._current = load_step(self.files[self.file_index])
            take = self._current[self.offset:self.offset + num_samples - len(batch)]
            batch += take
            self.offset += len(take)
            if self.offset >= len(self._current):
                self.file_index, self.offset, self._current = self.file_index + 1, 0, None
        self._last, self._version = batch, current_version
        return batch

    def metrics(self) -> dict:
        return batch_metrics(self._last, self._version)

    def state_dict(self) -> dict:
        return {"file_index": self.file_index, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.file_index, self.offset, self._current = state["file_index"], state["offset"], None
