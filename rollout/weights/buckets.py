"""Sender side of the weight-update group (`create_sender_group`, `broadcast_flat`) and the
flattened-bucket payload (`Bucket`, `iter_buckets`).

Group formation follows SGLang's init_custom_process_group (docs/engines.md): the sender is rank 0
and hosts a TCPStore at master_address:master_port; every engine rank r joins with
rendezvous("tcp://addr:port", r, world), wraps the store in PrefixStore(group_name, store) and builds
a backend group on it. That group is separate from the default (Megatron) process group, so the
trainer's own groups are never touched.

Payload of one bucket (load_format "flattened_bucket"): ONE uint8 tensor, the concatenation in
`names` order of each tensor's bytes (t.contiguous().view(-1).view(uint8)), no padding; its length is
sum(numel * itemsize). This is SGLang's FlattenedTensorBucket layout. Its receiver refuses a tensor
whose byte offset is not a multiple of its element size (FlattenedTensorBucket.empty,
weight_sync/tensor_bucket.py), and the layout has no room for padding, so a bucket lists its tensors
by descending element size: element sizes are powers of two, so every offset is then aligned (an
odd-length bf16 tensor before an fp32 one would not be).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

from .fp8_blocks import SCALE_SUFFIX


class ReceiveBuffer:
    """A receiver's flat uint8 buffer, reused for every bucket and grown only when a bucket is larger.
    A fresh buffer per bucket pays the allocation and the page faults of every byte on each call: for a
    517 MiB payload that alone halved a plain gloo broadcast on a CPU box (issue 29). The caller must not
    keep views of it past the next `take` (the receivers copy each tensor out: unflatten, keep)."""

    def __init__(self):
        self.flat: Optional[torch.Tensor] = None

    def take(self, nbytes: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """The first `nbytes` of the buffer on `device` (a new one when it is smaller or elsewhere)."""
        device = torch.device(device)
        if self.flat is None or self.flat.numel() < nbytes or self.flat.device != device:
            self.flat = None   # free the old one before the larger one is allocated
            self.flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.flat[:nbytes]


@dataclass
class Bucket:
    names: list[str]
    tensors: list[torch.Tensor]
    nbytes: int = 0
    header: Optional[tuple] = None   # meta() kept by release()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(tensor)
        self.nbytes += tensor.numel() * tensor.element_size()

    def aligned(self) -> "Bucket":
        """The same tensors by descending element size (stable), so each starts at a multiple of its
        own element size in the payload."""
        order = sorted(range(len(self.names)), key=lambda i: -self.tensors[i].element_size())
        return Bucket([self.names[i] for i in order], [self.tensors[i] for i in order], self.nbytes)

    def meta(self) -> tuple[list[str], list[str], list[list[int]]]:
        """(names, dtype names as SGLang resolves them with getattr(torch, name), shapes)."""
        if self.header is not None:
            return self.header
        return (list(self.names), [str(t.dtype).removeprefix("torch.") for t in self.tensors],
                [list(t.shape) for t in self.tensors])

    def release(self) -> "Bucket":
        """Drop the tensors once the payload holds their bytes, keeping meta(): a bucket on the wire
        holds its flat payload only (the sender's memory bound, weight_sync.max_sender_mb)."""
        self.header = self.meta()
        self.tensors = []
        return self

    def flatten(self, device: str | torch.device = "cpu", out: torch.Tensor | None = None) -> torch.Tensor:
        """The payload, written into `out` (a reusable uint8 buffer of >= nbytes) when given. A copy loop
        into one buffer: on CPU torch.cat of many uint8 views measured 4-9x slower (64 MiB: 170-390 ms
        vs 42 ms) and a fresh buffer per bucket pays its page faults every time. CPU to CPU the copy
        goes through numpy (copy_bytes); otherwise one copy per tensor even when it is strided (a row
        split's slice), through a typed view of its place (aligned() makes each place aligned)."""
        if out is None or out.numel() < self.nbytes:
            out = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        flat, offset = out[: self.nbytes], 0
        for t in self.tensors:
            nbytes = t.numel() * t.element_size()
            if flat.device.type == "cpu" and t.device.type == "cpu":
                copy_bytes(flat[offset: offset + nbytes], t)
            else:
                flat[offset: offset + nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
            offset += nbytes
        return flat


    def in_place(self, device: str | torch.device) -> Optional[torch.Tensor]:
        """The payload without a copy, when the tensors already lie back to back, contiguous, in one
        storage on `device` (a tensor alone in its bucket, or views of one buffer in order): a uint8 view
        of that memory, which the caller must not write. None otherwise (flatten copies)."""
        device, end = torch.device(device), None
        for t in self.tensors:
            if t.device != device or not t.is_contiguous() or (end is not None and t.data_ptr() != end):
                return None
            end = t.data_ptr() + t.numel() * t.element_size()
        if not self.tensors or len({t.untyped_storage().data_ptr() for t in self.tensors}) != 1:
            return None
        first = self.tensors[0]
        offset = first.data_ptr() - first.untyped_storage().data_ptr()
        return torch.empty(0, dtype=torch.uint8, device=device).set_(first.untyped_storage(), offset, (self.nbytes,))


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (contiguous CPU uint8) <- the bytes of src (a CPU tensor of any dtype, its last dimension
    contiguous; strided rows allowed). Through numpy: one plain single-threaded copy that releases the
    GIL. torch's copy_ splits a large copy over its intra-op threads, and on a CPU whose cores are busy
    (the sender's other threads, receivers, other processes) that made a 66 MiB flatten take 1.3-4.8 s
    instead of 0.03 s (2 threads vs 1, this 2-core machine under load). The source is read through a
    numpy view of its raw address, not `Tensor.numpy()`: that marks the storage as shared with numpy,
    never resizable again, and the source may be a live parameter (an export without a snapshot),
    whose storage the trainer frees between steps (parallel/offload.py: resize_(0))."""
    import ctypes

    import numpy as np

    if src.dim() == 0 or src.stride(-1) != 1:
        src = src.reshape(-1) if src.dim() == 0 else src.contiguous()
    raw = src.detach().view(torch.uint8)   # a torch view: last dim = the row's bytes
    if raw.numel() == 0:
        return
    span = 1 + sum((size - 1) * stride for size, stride in zip(raw.shape, raw.stride()))
    memory = np.frombuffer((ctypes.c_uint8 * span).from_address(raw.data_ptr()), dtype=np.uint8)
    view = np.lib.stride_tricks.as_strided(memory, shape=tuple(raw.shape), strides=tuple(raw.stride()),
                                           writeable=False)
    np.copyto(dst.numpy().reshape(view.shape), view)


_Q_A = ".self_attn.q_a_proj.weight"
_KV_A = ".self_attn.kv_a_proj_with_mqa.weight"


def joins_previous(previous: str, name: str) -> bool:
    """Tensors SGLang must get in the same update call as the one before them (one past the bound):
    - an FP8 scale (`..._scale_inv`, fp8_blocks.py) with its weight: the DeepSeek loader re-derives
      MLA's w_kc/w_vc from kv_b_proj's weight and scale in the call that loads them
      (models/deepseek_common/deepseek_weight_loader.py:550, :586-661);
    - MLA's kv_a_proj_with_mqa with its layer's q_a_proj (and their scales): with q LoRA the DeepSeek
      loader fuses the two into fused_qkv_a_proj_with_mqa from a cache local to one load_weights call
      and silently drops a half whose partner is in another call (deepseek_weight_loader.py:279-283,
      :438-513). `mla_a_pairs` puts them next to each other."""
    if name.endswith(SCALE_SUFFIX):
        return True
    return name.endswith(_KV_A) and previous.removesuffix(SCALE_SUFFIX) == name.removesuffix(_KV_A) + _Q_A


def mla_a_pairs(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Hold each layer's q_a_proj back until its kv_a_proj_with_mqa comes, then yield the two together
    (the export yields q_b_proj between them); every other tensor passes in order."""
    held: dict[str, tuple] = {}
    for item in named:   # (name, tensor), or (name, tensor, share) from a holder's export: kept whole
        name = item[0]
        if name.endswith(_Q_A):
            held[name.removesuffix(_Q_A)] = item
            continue
        if name.endswith(_KV_A) and name.removesuffix(_KV_A) in held:
            yield held.pop(name.removesuffix(_KV_A))
        yield item
    yield from held.values()   # no partner (q LoRA without kv_a: not a model SGLang fuses)


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
            and not name.endswith((_Q_A, _KV_A, SCALE_SUFFIX)))


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


def create_sender_group(master_address: str, master_port: int, world_size: int, group_name: str,
                        backend: str, timeout_s: float):
    """Rank 0 of the weight-update group: host the store and wait for every engine rank to join."""
    from torch.distributed import distributed_c10d as c10d

    from sao_megatron.core.binding import bound_store

    timeout = datetime.timedelta(seconds=timeout_s)
    # Our own store (never torchrun's agent store), listening on master_address alone: the address the
    # engines are told, not every interface of the trainer's node.
    store, rank, world = bound_store(master_address, master_port, world_size, True, timeout_s), 0, world_size
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(backend),
                                              c10d.PrefixStore(group_name, store),
                                              group_name=group_name, timeout=timeout)
    # Ranks of a helper-built group are its own; register the identity map so collectives accept it.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group


def broadcast_flat(flat: torch.Tensor, group) -> None:
    """The sender's half of one bucket (or of the benchmark's raw baseline): rank 0 broadcasts `flat`
    to every engine rank of the weight-update group."""
    import torch.distributed as dist

    dist.broadcast(flat, src=0, group=group)
