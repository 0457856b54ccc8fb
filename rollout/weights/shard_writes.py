"""ShardWriteSync (weight_sync.method = "shard_writes"): every engine TP rank receives only its slice.

A broadcast sends every byte to every engine rank: an engine of N GPUs takes in N times the model.
Here the engine ranks are split among `senders` lanes; lane k forms its own group (k's thread is
rank 0, its engine ranks 1..) and sends each of its ranks, in buckets, the slice that rank holds
(shard_plan.py), over the wire of shard_wire.py. Memory: the export streams; a lane holds two flat
buffers, SHARD_QUEUE_DEPTH queued buckets and the one it flattens, and each of its ranks one pending
bucket of copied slices (a tensor above the bucket alone), which weight_sync.max_sender_mb counts
(memory.py). The lanes run in parallel, each on its own group,
so the ranks of one engine receive at once instead of one broadcast after another. In a multi-rank
trainer every rank runs one ShardWriteSync: its export yields (name, tensor, (i, n)) for the tensors
its TP group gathered, and holder i of n serves the engine-rank slots equal to i mod n, so a tensor
leaves from every rank that holds it and no rank holds the whole model.

What it requires (the name says so): engines that take writes into each TP rank's own weights.
SGLang 0.5.23 does that only through its Mooncake transfer engine (docs/weights.md, "Shard writes"),
which this class does not drive; it drives the reference server's stand-in (`sao serve --tp N
--shard-writes`, rollout/engines/reference_server/shard_writes.py). Inside the update window: the caller holds
the session (update_session), a push writes the slices, collects one ack per rank (bytes received,
first refusal), then labels the version with /update_weight_version (SGLang's route: a write into
memory carries no version).
"""
from __future__ import annotations

import itertools
import queue
import threading
import uuid
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from rollout.engines.engine import EngineError
from sao_megatron.core.backends import resolve_backend
from sao_megatron.core.ports import free_port

from . import memory
from .base import SessionSync, engine_ranks, sender_address
from .buckets import Bucket, create_sender_group
from .calls import in_daemon_thread, payload_device, pinned, run_all
from .receiver import WeightReceiver
from .shard_plan import shard_of
from .shard_wire import CLOSE, END, recv_ack, send_bucket, send_control


@dataclass(frozen=True)
class Target:
    engine: int       # index into the sync's engines
    name: str         # the engine's name
    rank: int         # its TP rank
    tp: int           # its TP size
    slot: int = 0     # its place among all engine ranks (a tensor's holder i of n serves slots = i mod n)

    def label(self) -> str:
        return f"engine {self.name} tp_rank {self.rank}"


class _LaneFailed(RuntimeError):
    """The producer stops feeding a lane whose thread failed (the lane's own error is the one raised)."""


def flatten_slices(bucket: Bucket, out: Optional[torch.Tensor],
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, buffer): Bucket.flatten into a reused uint8 buffer, grown when needed (one copy per
    slice even when it is strided; a GPU slice into a CPU buffer, gloo from a GPU trainer, is one
    device-to-host copy)."""
    if out is None or out.numel() < bucket.nbytes:
        out = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    return bucket.flatten(device, out), out


class _Lane:
    """One sender: its group, the engine ranks it serves (group ranks 1..), a bounded queue of sliced
    buckets filled by the producer, and the thread that puts them on the wire."""

    def __init__(self, index: int, targets: list[Target]):
        self.index, self.targets = index, targets
        self.group, self.group_name, self.port = None, "", 0
        self._buffers: list[Optional[torch.Tensor]] = [None, None]

    def start_push(self, bucket_bytes: int, timeout_s: float) -> None:
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.queue: queue.Queue = queue.Queue(maxsize=memory.SHARD_QUEUE_DEPTH)   # memory.py counts these + 1
        self.pending = [Bucket([], []) for _ in self.targets]
        self.sent = [0] * len(self.targets)
        self.failed = threading.Event()

    def add(self, name: str, tensor: torch.Tensor, share: tuple[int, int] = (0, 1)) -> None:
        """Producer side: each target's slice of one tensor into that target's bucket, for the targets
        this sender serves as holder `share` = (i, n) of the tensor (slots equal to i mod n). A slice
        is copied out: a view would keep the whole gathered tensor alive for as long as its bucket
        waits, so each pending bucket would pin up to tp times its own bytes (max_sender_mb counts slices)."""
        index, holders = share
        for j, target in enumerate(self.targets):
            if target.slot % holders != index:
                continue
            piece = shard_of(name, tensor, target.tp, target.rank)
            if piece is not tensor:
                piece = piece.clone(memory_format=torch.contiguous_format)
            bucket = self.pending[j]
            if bucket.names and bucket.nbytes + piece.numel() * piece.element_size() > self.bucket_bytes:
                self._put((j, bucket.aligned()))
                bucket = self.pending[j] = Bucket([], [])
            bucket.add(name, piece)

    def finish(self) -> None:
        for j, bucket in enumerate(self.pending):
            if bucket.names:
                self._put((j, bucket.aligned()))
        self._put(None)

    def _put(self, item) -> None:
        while not self.failed.is_set():
            try:
                self.queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue
        raise _LaneFailed(f"sender {self.index} failed")

    def run(self, device: torch.device) -> list[tuple[Target, bool, int, str]]:
        """Lane thread: send buckets (bucket i+1 is flattened while bucket i is on the wire), then END to
        every target and its ack: [(target, ok, bytes it received, its first refusal)]."""
        try:
            return self._run(device)
        except BaseException as err:
            self.failed.set()
            if isinstance(err, queue.Empty):
                raise RuntimeError(f"sender {self.index}: the export fed no bucket within "
                                   f"{self.timeout_s:.0f}s") from None
            raise

    def _run(self, device: torch.device) -> list[tuple[Target, bool, int, str]]:
        in_flight: list = [None, None]
        for i in itertools.count():
            item = self.queue.get(timeout=self.timeout_s)
            if item is None:
                break
            j, bucket = item
            slot = i % 2
            if in_flight[slot] is not None:
                in_flight[slot].wait()
            flat, self._buffers[slot] = flatten_slices(bucket, self._buffers[slot], device)
            names, dtypes, shapes = bucket.meta()
            del item, bucket   # the payload holds the bytes: no slice (a view of a full tensor) waits here
            in_flight[slot] = self._wire(j, lambda: send_bucket(
                {"names": names, "dtypes": dtypes, "shapes": shapes}, flat, j + 1, self.group))
            self.sent[j] += flat.numel()
        for work in in_flight:
            if work is not None:
                work.wait()
        return [(t, *self._wire(j, lambda: self._ack(j))) for j, t in enumerate(self.targets)]

    def _ack(self, j: int) -> tuple[bool, int, str]:
        send_control(END, j + 1, self.group)
        return recv_ack(j + 1, self.group)

    def _wire(self, j: int, fn):
        try:
            return fn()
        except RuntimeError as err:   # gloo: a closed peer or the group timeout
            raise RuntimeError(f"sender {self.index} -> {self.targets[j].label()}: {err}") from err

    def close_targets(self) -> None:
        for j in range(len(self.targets)):
            send_control(CLOSE, j + 1, self.group)


class ShardWriteSync(SessionSync):
    def __init__(self, cfg, engines: list[WeightReceiver], *, ranks_per_engine: int | Sequence[int] = 1,
                 senders: Optional[int] = None, master_address: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None, labels_versions: bool = True):
        super().__init__(cfg, engines, dtype)
        self.engine_ranks = engine_ranks(ranks_per_engine, len(self.engines))
        targets = [Target(i, e.name, r, tp) for i, (e, tp) in enumerate(zip(self.engines, self.engine_ranks))
                   for r in range(tp)]
        targets = [replace(t, slot=k) for k, t in enumerate(targets)]
        count = senders if senders is not None else cfg.shard_senders
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"weight_sync.shard_senders {count!r} must be an int >= 1; fix: use e.g. 2")
        count = min(count, len(targets))
        self.lanes = [_Lane(k, targets[k::count]) for k in range(count)]
        self.master_address = master_address or sender_address(self.engines)
        if cfg.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("weight_sync.backend = 'nccl' needs CUDA, and this process sees no GPU; "
                             "fix: set weight_sync.backend to 'gloo' or 'auto'")
        self.backend = resolve_backend(cfg.backend)
        self.connected = False
        self.bytes_sent = 0
        self.received: dict[tuple[str, int], int] = {}   # (engine, tp_rank) -> bytes it acked, last push
        # One of several senders (every trainer rank sends its share, plan.py): the version is labelled
        # once, by the driver rank after every rank's push landed (label_version).
        self.labels_versions = labels_versions

    def _entries(self, engine: int) -> list[dict]:
        return [{"tp_rank": t.rank, "master_port": lane.port, "group_name": lane.group_name, "group_rank": j + 1,
                 "world_size": len(lane.targets) + 1}
                for lane in self.lanes for j, t in enumerate(lane.targets) if t.engine == engine]

    def _form_groups(self) -> None:
        """The lanes' groups, one after another in this thread; the engines join all of theirs at once."""
        for lane in self.lanes:
            lane.group = create_sender_group(self.master_address, lane.port, len(lane.targets) + 1, lane.group_name,
                                             self.backend, self.cfg.timeout_s)

    async def connect(self) -> None:
        """Every lane's group (its sender + the engine ranks it serves); idempotent."""
        if self.connected:
            return
        tag = uuid.uuid4().hex[:8]
        for lane in self.lanes:
            lane.port, lane.group_name = free_port(""), f"sao_shards_s{lane.index}_{tag}"
        calls = {f"engine {e.name}": e.join_shard_groups(self.master_address, self._entries(i))
                 for i, e in enumerate(self.engines)}
        calls["trainer senders"] = in_daemon_thread(self._form_groups)
        await run_all(calls, f"joining {len(self.lanes)} shard group(s) ({self.backend})", self.cfg.timeout_s)
        self.connected = True

    def regroup(self) -> None:
        """New lanes on new groups at the next push (the old lanes' groups hold the replaced process)."""
        self.connected = False
        self.lanes = [_Lane(lane.index, lane.targets) for lane in self.lanes]

    async def _transfer(self, named_tensors, version: int) -> None:
        await self.connect()
        device = payload_device(self.backend)
        for lane in self.lanes:
            lane.start_push(int(self.cfg.bucket_mb * 2**20), self.cfg.timeout_s)
        # The export runs in the producer thread on the caller's CUDA device (a new thread starts on cuda:0).
        caller = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else device
        calls = {"trainer export (slicing)": in_daemon_thread(pinned, caller, self._produce, named_tensors)}
        calls |= {f"trainer sender {lane.index}": in_daemon_thread(pinned, device, lane.run, device)
                  for lane in self.lanes}
        try:   # no overall deadline: every wire step and every queue wait is bounded by cfg.timeout_s
            results = await run_all(calls, f"shard writes (version {version})", None)
        except EngineError:
            # A broken lane's group is unusable, and its thread may still wait on its queue: the next
            # push forms new groups with new lanes, so no old thread ever reads a new push's buckets.
            self.regroup()
            raise
        self._check_acks([ack for lane_acks in results[1:] for ack in lane_acks])
        if self.labels_versions:
            await self.label_version(version)

    async def label_version(self, version: int) -> None:
        """/update_weight_version on every engine (SGLang's route: a write into memory carries none)."""
        await run_all(self._each(lambda e: e.update_weight_version(version)), "update_weight_version",
                      self.cfg.timeout_s)

    def _produce(self, named_tensors) -> None:
        try:
            for item in named_tensors:   # (name, tensor), or (name, tensor, (i, n)) from a holder's export
                for lane in self.lanes:
                    lane.add(*item)
            for lane in self.lanes:
                lane.finish()
        except _LaneFailed:
            return

    def _check_acks(self, acks: list[tuple[Target, bool, int, str]]) -> None:
        sent = {t: lane.sent[j] for lane in self.lanes for j, t in enumerate(lane.targets)}
        for target, ok, nbytes, message in acks:
            if not ok:
                raise EngineError(f"{target.label()}: refused shard writes: {message}")
            if nbytes != sent[target]:
                raise EngineError(f"{target.label()}: received {nbytes} bytes of shard writes, the sender "
                                  f"sent {sent[target]}")
            self.received[(target.name, target.rank)] = nbytes
        self.bytes_sent += sum(sent.values())

    async def close(self) -> None:
        if not self.connected:
            return
        self.connected = False
        await run_all({f"trainer sender {lane.index}": in_daemon_thread(lane.close_targets) for lane in self.lanes},
                      "closing shard groups", self.cfg.timeout_s)
        names = [lane.group_name for lane in self.lanes]
        await run_all(self._each(lambda e: e.destroy_shard_groups(names)), "destroy_shard_groups", self.cfg.timeout_s)
        import torch.distributed as dist

        for lane in self.lanes:
            dist.destroy_process_group(lane.group)
            lane.group = None
