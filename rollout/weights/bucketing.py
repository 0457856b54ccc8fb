"""How the broadcast sender cuts its stream of tensors into buckets (`iter_buckets`): flat buckets of at
most the bucket size, copied into the reused payload buffers (buckets.py), and runs of the model's own
memory sent as they lie.

With the payload device given, contiguous views of a larger storage there (the parameters of Megatron's
contiguous buffer, which the export without a snapshot yields, parallel/weights.py) are held until they
lie back to back in a run of a bucket, in any order of arrival (Megatron lays its parameters out last
first, the export walks them in name order), and each run becomes a bucket of its own, in address order,
that `Bucket.in_place` sends from that memory: no copy (docs/weight-transports.md, "Broadcast against its
ceiling").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

from .buckets import Bucket, joins_previous, pairs_with_a_neighbour

HELD_VIEWS_BUCKETS = 2   # buckets of views held while they may still join a run (a whole run and the views
#                          around it still waiting for their neighbours): a bound on the wait, not on memory
RUN_MIN_FRACTION = 4     # a run shorter than bucket / this is copied: its own update call would cost more


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _may_run(name: str, t: torch.Tensor, device: Optional[torch.device]) -> bool:
    """A contiguous view of a larger storage on the payload device (a parameter in Megatron's contiguous
    param buffer, exported without a snapshot), and no tensor a neighbour must share a call with."""
    return (device is not None and t.device == device and t.is_contiguous() and t.numel() > 0
            and t.untyped_storage().nbytes() > _nbytes(t)
            and not pairs_with_a_neighbour(name))


@dataclass
class _Segment:
    """Held views lying back to back in one storage: bytes [start, end); items (name, view, arrival), in
    no particular order."""
    start: int
    end: int
    items: list

    def ordered(self) -> list:
        return sorted(self.items, key=lambda item: item[1].data_ptr())


class _Runs:
    """Views of larger storages held until they lie back to back in runs of a bucket (they cost no memory
    when their storage is the model's own), in any order of arrival: Megatron lays its parameters out in
    reverse, the export walks them in name order. Segments are merged as views arrive (by their first
    and one-past-last addresses), so holding n views costs O(n)."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes, self.nbytes, self.arrivals = bucket_bytes, 0, 0
        self.by_start: dict[int, _Segment] = {}
        self.by_end: dict[int, _Segment] = {}
        self.home: dict[str, _Segment] = {}   # tensor name -> its segment

    def add(self, name: str, t: torch.Tensor) -> list[Bucket]:
        """Hold `t`; the buckets of whole runs that now exist."""
        start = t.data_ptr()
        self.arrivals += 1
        segment = self._put(_Segment(start, start + _nbytes(t), [(name, t, self.arrivals)]))
        self.nbytes += _nbytes(t)
        before = self.by_end.get(segment.start)
        if before is not None and before.items[0][1].dtype == t.dtype:
            segment = self._merge(before, segment)
        after = self.by_start.get(segment.end)
        if after is not None and after.items[0][1].dtype == t.dtype:
            segment = self._merge(segment, after)
        ready = []
        while segment is not None and segment.end - segment.start >= self.bucket_bytes:
            # a full bucket leaves from the end whose views came first: the run keeps growing where the
            # newest came in (Megatron's reversed layout: downwards), so what stays can join the next ones
            items, size, take = segment.ordered(), 0, 0
            downwards = items[0][2] > items[-1][2]
            if downwards:
                items.reverse()
            while take < len(items) and (take == 0 or size + _nbytes(items[take][1]) <= self.bucket_bytes):
                size += _nbytes(items[take][1])
                take += 1
            self._drop(segment)
            sent, kept = items[:take], items[take:]
            ready.append(_bucket_of(sent[::-1] if downwards else sent))
            segment = self._segment_of(kept[::-1] if downwards else kept)
        return ready

    def over(self) -> bool:
        return self.nbytes > HELD_VIEWS_BUCKETS * self.bucket_bytes

    def free(self, t: torch.Tensor) -> bool:
        """No held view starts or ends where `t` does (a tied weight exported under two names is one
        memory twice: the second copy is copied)."""
        return t.data_ptr() not in self.by_start and t.data_ptr() + _nbytes(t) not in self.by_end

    def drain(self, down_to: float) -> tuple[list[Bucket], list[tuple[str, torch.Tensor]]]:
        """Release the longest runs until at most `down_to` bytes are held: (runs sent from their memory,
        tensors of runs too short for that, to be copied)."""
        ready, spill = [], []
        for segment in sorted(self.by_start.values(), key=lambda seg: seg.start - seg.end):
            if self.nbytes <= down_to:
                break
            self._drop(segment)
            bucket = _bucket_of(segment.ordered())
            if bucket.nbytes * RUN_MIN_FRACTION >= self.bucket_bytes:
                ready.append(bucket)
            else:
                spill += zip(bucket.names, bucket.tensors)
        return ready, spill

    def remove(self, name: str) -> Optional[tuple[str, torch.Tensor]]:
        """Take one held view out (its segment splits where it was)."""
        segment = self.home.get(name)
        if segment is None:
            return None
        self._drop(segment)
        items = segment.ordered()
        k = next(i for i, item in enumerate(items) if item[0] == name)
        self._segment_of(items[:k])
        self._segment_of(items[k + 1:])
        return items[k][:2]

    def _put(self, segment: _Segment) -> _Segment:
        self.by_start[segment.start], self.by_end[segment.end] = segment, segment
        for name, *_ in segment.items:
            self.home[name] = segment
        return segment

    def _drop(self, segment: _Segment) -> None:
        """Forget a segment; its bytes are no longer held unless put back."""
        del self.by_start[segment.start], self.by_end[segment.end]
        for name, t, _ in segment.items:
            del self.home[name]
            self.nbytes -= _nbytes(t)

    def _segment_of(self, items: list) -> Optional[_Segment]:
        """Hold `items` (back to back, in address order) again as one segment."""
        if not items:
            return None
        self.nbytes += sum(_nbytes(item[1]) for item in items)
        last = items[-1][1]
        return self._put(_Segment(items[0][1].data_ptr(), last.data_ptr() + _nbytes(last), list(items)))

    def _merge(self, low: _Segment, high: _Segment) -> _Segment:
        """One segment of two adjacent ones (low ends where high starts): the larger one absorbs the
        smaller, so a run growing either way costs O(1) per view."""
        del self.by_start[low.start], self.by_end[low.end], self.by_start[high.start], self.by_end[high.end]
        keep, other = (low, high) if len(low.items) >= len(high.items) else (high, low)
        keep.start, keep.end = low.start, high.end
        keep.items.extend(other.items)
        for name, *_ in other.items:
            self.home[name] = keep
        self.by_start[keep.start], self.by_end[keep.end] = keep, keep
        return keep


def _bucket_of(items: list) -> Bucket:
    bucket = Bucket([], [])
    for name, t, *_ in items:
        bucket.add(name, t)
    return bucket


def _pull(buckets: list[Bucket], name: str) -> Optional[tuple[str, torch.Tensor]]:
    """Take tensor `name` out of the bucket of `buckets` that has it (that bucket is then copied if its
    run has a gap)."""
    for i, bucket in enumerate(buckets):
        if name in bucket.names:
            k = bucket.names.index(name)
            item = (bucket.names[k], bucket.tensors[k])
            rest = Bucket([], [])
            for n, t in zip(bucket.names, bucket.tensors):
                if n != name:
                    rest.add(n, t)
            buckets[i:i + 1] = [rest] if rest.names else []
            return item
    return None


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 device: Optional[torch.device | str] = None) -> Iterator[Bucket]:
    """Group a stream into aligned buckets of at most `bucket_bytes` (a larger tensor travels alone);
    a tensor that `joins_previous` stays in the bucket of the one before it.

    With `device` (the payload device), contiguous views of a larger storage there (`_may_run`: the
    parameters of Megatron's contiguous buffer, exported without a snapshot) are held until they lie
    back to back in a run of a bucket, which becomes a bucket of its own, in address order, that
    `Bucket.in_place` sends from the model's memory: no copy. Every other tensor, and runs that stay
    shorter than bucket / RUN_MIN_FRACTION, are copied into flat buckets as without `device`. Held views
    are bounded by HELD_VIEWS_BUCKETS buckets. Each tensor goes in exactly one bucket."""
    device = torch.device(device) if device is not None else None
    runs, current, previous = _Runs(bucket_bytes), Bucket([], []), None

    def copy(name: str, tensor: torch.Tensor, joins: bool = False):
        nonlocal current
        if current.names and current.nbytes + _nbytes(tensor) > bucket_bytes and not joins:
            yield current.aligned()
            current = Bucket([], [])
        current.add(name, tensor)

    pending: list[Bucket] = []   # runs the last tensor completed: yielded once the next does not join it
    for name, tensor in named_tensors:
        joins = previous is not None and joins_previous(previous, name)
        if joins and (held := runs.remove(previous) or _pull(pending, previous)) is not None:
            yield from copy(*held)        # the two must share a call: both copied
        yield from (b.aligned() for b in pending)
        pending = []
        if not joins and _may_run(name, tensor, device) and runs.free(tensor):
            pending = runs.add(name, tensor)
            if runs.over():
                ready, spill = runs.drain(HELD_VIEWS_BUCKETS * bucket_bytes / 2)
                pending += ready
                for item in sorted(spill, key=lambda it: it[0] == name):   # this one last: a joiner may follow
                    yield from copy(*item)
        else:
            yield from copy(name, tensor, joins)
        previous = name
    ready, spill = runs.drain(0)
    yield from (b.aligned() for b in pending + ready)
    for item in spill:
        yield from copy(*item)
    if current.names:
        yield current.aligned()
