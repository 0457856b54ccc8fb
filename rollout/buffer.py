"""SampleBuffer: finished samples wait here until the trainer takes them.

- Group mode: samples of one prompt (same ``group_id``) are held until all ``group_size`` members
  arrive, then released as one unit; batches always contain whole groups.
- Filters (``Callable[[list[Sample]], bool]``) run on each complete group; a group with a FAILED
  member is dropped (its reward is not comparable), counted in ``dropped_failed``.
- Batches are taken oldest first, by sample count or by a token budget.
- Memory is bounded: the driver stops submitting work when ``room()`` reaches 0.
- ``state_dict()`` holds every sample (ready and partial groups) so a resume loses nothing.
"""
from __future__ import annotations

import copy
from collections import deque
from typing import Callable, Iterable, Optional

from rollout.staleness import is_stale
from sao_megatron.core.records import Sample, SampleStatus

GroupFilter = Callable[[list[Sample]], bool]


def nonzero_reward_variance(group: list[Sample]) -> bool:
    """DAPO dynamic sampling: keep a group only if its rewards are not all equal."""
    return len({s.reward for s in group}) > 1


FILTERS = {"nonzero_reward_variance": nonzero_reward_variance}


class SampleBuffer:
    def __init__(self, group_size: int = 1, capacity: int = 1024, filters: Iterable[GroupFilter] = ()):
        if capacity < group_size:
            raise ValueError(f"buffer capacity {capacity} < group size {group_size}; raise the capacity")
        self.group_size, self.capacity = group_size, capacity
        self.filters = list(filters)
        self._ready: deque[list[Sample]] = deque()
        self._partial: dict[int, list[Sample]] = {}
        self.dropped_failed = 0
        self.dropped_filtered = 0

    # ---- intake ------------------------------------------------------------------------------
    def put(self, sample: Sample) -> Optional[list[Sample]]:
        """Add a finished sample; returns the group if this completed one that was accepted."""
        members = self._partial.setdefault(sample.group_id, [])
        if any(m.uid == sample.uid for m in members):
            raise ValueError(f"sample {sample.uid} was put into the buffer twice")
        members.append(sample)
        if len(members) < self.group_size:
            return None
        del self._partial[sample.group_id]
        return self._accept(sorted(members, key=lambda s: s.uid))

    def _accept(self, group: list[Sample]) -> Optional[list[Sample]]:
        if any(s.status == SampleStatus.FAILED for s in group):
            self.dropped_failed += len(group)
            return None
        if not all(f(group) for f in self.filters):
            self.dropped_filtered += len(group)
            return None
        self._ready.append(group)
        return group

    # ---- output ------------------------------------------------------------------------------
    @property
    def num_ready(self) -> int:
        return sum(len(g) for g in self._ready)

    @property
    def num_partial(self) -> int:
        return sum(len(g) for g in self._partial.values())

    def room(self) -> int:
        return self.capacity - self.num_ready - self.num_partial

    def take_stale(self, current_version: int, bound: int) -> list[list[Sample]]:
        """Remove and return ready groups whose oldest token is more than `bound` versions old."""
        stale = [g for g in self._ready if is_stale(g, current_version, bound)]
        if stale:
            self._ready = deque(g for g in self._ready if not is_stale(g, current_version, bound))
        return stale

    def ready_tokens(self) -> int:
        return sum(s.num_tokens for g in self._ready for s in g)

    def pop(self, num_samples: Optional[int] = None, max_tokens: Optional[int] = None) -> list[Sample]:
        """Oldest whole groups: exactly `num_samples` samples, or as many as fit in `max_tokens`.

        Raises if fewer are ready (check `num_ready` first); a token budget always yields at least
        one group so an oversized sample cannot stall training.
        """
        if (num_samples is None) == (max_tokens is None):
            raise ValueError("pop needs exactly one of num_samples or max_tokens")
        out: list[Sample] = []
        if num_samples is not None:
            if num_samples % self.group_size:
                raise ValueError(f"batch of {num_samples} samples is not a multiple of the group size "
                                 f"{self.group_size}; make rollout.batch_size a multiple")
            if num_samples > self.num_ready:
                raise ValueError(f"asked for {num_samples} samples, {self.num_ready} ready")
            while len(out) < num_samples:
                out.extend(self._ready.popleft())
            return out
        used = 0
        while self._ready:
            cost = sum(s.num_tokens for s in self._ready[0])
            if out and used + cost > max_tokens:
                break
            used += cost
            out.extend(self._ready.popleft())
        return out

    # ---- resume ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "ready": [[copy.deepcopy(s.to_dict()) for s in g] for g in self._ready],
            "partial": [copy.deepcopy(s.to_dict()) for g in self._partial.values() for s in g],
            "dropped_failed": self.dropped_failed, "dropped_filtered": self.dropped_filtered,
        }

    def load_state_dict(self, state: dict) -> None:
        self._ready = deque([Sample.from_dict(d) for d in g] for g in state["ready"])
        self._partial = {}
        for d in state["partial"]:
            s = Sample.from_dict(d)
            self._partial.setdefault(s.group_id, []).append(s)
        self.dropped_failed, self.dropped_filtered = state["dropped_failed"], state["dropped_filtered"]
