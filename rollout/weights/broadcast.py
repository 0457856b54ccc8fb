"""BroadcastWeightSync (weight_sync.method = "broadcast"): one process group spanning the sender and every
engine's TP ranks; every engine rank receives every byte.

Engine i joins with rank_offset = 1 + the TP sizes of the engines before it (SGLang adds its tp_rank).
Flattened buckets of cfg.bucket_mb, non-expert tensors before expert ones; per bucket the engines'
/update_weights_from_distributed calls run concurrently with the sender's broadcast. nccl with CUDA,
gloo otherwise. FP8 engines (rollout.engine_fp8, `fp8=Fp8Layout`): the tensors the engine holds in FP8
go as float8_e4m3fn 128x128 blocks followed by their float32 `<name>_scale_inv` (fp8_blocks.py), every
other tensor as exported; a scale stays next to its weight in the stream and in one bucket. Over gloo
they travel inside the flattened uint8 payload (gloo's broadcast refuses float8 tensors: "Invalid scalar
type"); SGLang's receiver views its bucket as float8 (weight_sync/tensor_bucket.py).

Pipeline parallelism: a stage sender (weight_sync.senders = per_stage, plan.py) exports only its stage's
tensors and sends them through its own BroadcastWeightSync(stage=s) on its own group
`sao_weights_pp<s>_...` with the engines (engines join one group per stage; SGLang keeps several named
groups).
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Iterable, Optional, Sequence

import torch

from checkpoints.name_map import is_expert_hf_name
from rollout.engines.engine import EngineError
from sao_megatron.core.backends import resolve_backend
from sao_megatron.core.ports import free_port

from .base import SessionSync, engine_ranks, sender_address
from .bucketing import iter_buckets
from .buckets import Bucket, broadcast_flat, create_sender_group
from .calls import PushError, SerialThread, in_daemon_thread, payload_device, pinned, run_all
from .fp8_blocks import SCALE_SUFFIX, Fp8Layout
from .receiver import WeightReceiver

SENDER = "trainer sender (rank 0)"


def non_expert_first(named: Iterable[tuple[str, torch.Tensor]], max_held_bytes: int):
    """Non-expert tensors as they come; routed-expert tensors held back and released in runs of at
    most `max_held_bytes` (a bigger tensor alone), and the rest at the end.

    slime sends every non-expert tensor before the experts because its experts need their own
    expert-parallel gather. Ours come gathered from export_hf and SGLang loads each bucket by name,
    so the order is free for the engine; what we keep is that expert tensors travel together in
    bucket-sized runs. The bound (one bucket in training) is what the sender holds beyond the
    export: never every expert tensor of the model, which export_hf interleaves layer by layer.
    """
    held, held_bytes = [], 0
    for name, tensor in named:
        if not is_expert_hf_name(name):
            yield name, tensor
            continue
        size = tensor.numel() * tensor.element_size()
        if held and held_bytes + size > max_held_bytes and not name.endswith(SCALE_SUFFIX):   # a scale stays with its weight
            yield from held
            held, held_bytes = [], 0
        held.append((name, tensor))
        held_bytes += size
    yield from held


class BroadcastWeightSync(SessionSync):
    def __init__(self, cfg, engines: list[WeightReceiver], *, ranks_per_engine: int | Sequence[int] = 1,
                 master_address: Optional[str] = None, stage: int = 0, dtype: Optional[torch.dtype] = None,
                 fp8: Optional[Fp8Layout] = None):
        super().__init__(cfg, engines, dtype, fp8)
        self.engine_ranks, self.stage = engine_ranks(ranks_per_engine, len(self.engines)), stage
        self.master_address = master_address or sender_address(self.engines)
        if cfg.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("weight_sync.backend = 'nccl' needs CUDA, and this process sees no GPU; "
                             "fix: set weight_sync.backend to 'gloo' or 'auto'")
        self.backend = resolve_backend(cfg.backend)
        self.group, self.group_name = None, ""
        self.bytes_sent = 0
        self._buffers = [None, None]   # two reused flat payload buffers, grown to the largest bucket

    @property
    def world_size(self) -> int:
        return 1 + sum(self.engine_ranks)

    def rank_offsets(self) -> list[int]:
        """Engine i's rank_offset: SGLang joins its TP rank r as rank_offset + r
        (model_executor/model_runner_components/weight_updater.py), so the engines tile 1..world-1."""
        offsets, next_rank = [], 1
        for ranks in self.engine_ranks:
            offsets.append(next_rank)
            next_rank += ranks
        return offsets

    async def connect(self) -> None:
        """Form the weight-update group (sender rank 0 + every engine rank); idempotent."""
        if self.group is not None:
            return
        port, world = free_port(""), self.world_size   # every interface: remote engines connect
        name = f"sao_weights_pp{self.stage}_{uuid.uuid4().hex[:8]}"
        calls = {f"engine {e.name}": e.init_weights_update_group(self.master_address, port, offset, world, name,
                                                                 self.backend)
                 for e, offset in zip(self.engines, self.rank_offsets())}
        calls[SENDER] = in_daemon_thread(create_sender_group, self.master_address, port, world, name,
                                          self.backend, self.cfg.timeout_s)
        results = await run_all(calls, f"joining weight-update group {name} (world {world}, {self.backend})",
                                self.cfg.timeout_s)
        self.group, self.group_name = results[-1], name

    def regroup(self) -> None:
        self.group = None   # the old group (a dead peer in it) is left to the garbage collector

    async def _transfer(self, named_tensors, version: int) -> None:
        """Send the buckets in order, pipelined: bucket i+1 is flattened (into the other of two reused
        buffers) while bucket i is on the wire, and its broadcast leaves the sender as soon as bucket i's
        has, without waiting for the engines' replies to bucket i. Each engine gets bucket i+1's update
        call once every engine answered bucket i (SGLang takes one call at a time, in the order it gets
        them); until then the sender's bytes wait in the socket buffers, so the wire stays busy across
        the round trip of the call. At most two buckets are in flight: one flat buffer each. The payload
        device is captured here, in the caller's thread, and made current in the flatten and broadcast
        threads."""
        await self.connect()
        device = payload_device(self.backend)
        bucket_bytes = int(self.cfg.bucket_mb * 2**20)
        steps = []   # the buckets in flight, oldest first: (its broadcast, the whole bucket)
        wire = SerialThread("weight-sync-wire")   # the sender's broadcasts, one after the other
        try:
            for i, bucket in enumerate(iter_buckets(non_expert_first(named_tensors, bucket_bytes), bucket_bytes, device)):
                if len(steps) == 2:
                    await steps[0][1]       # bucket i-2 is done: its buffer is this bucket's
                    steps.pop(0)
                flat = await self._payload(bucket, device, i % 2)
                bucket.release()
                steps.append(self._start_bucket(bucket, flat, version, f"bucket {i}", wire,
                                                steps[-1][1] if steps else None))
            for _, done in steps:
                await done
        except BaseException:
            for sent, done in steps:
                for future in (done, sent):
                    if future.done():
                        future.cancelled() or future.exception()   # retrieved: raised once, below
                    else:
                        future.cancel()
            self.group = None  # a failed collective leaves the group unusable: rebuild on the next push
            raise
        finally:
            wire.close()

    async def _payload(self, bucket: Bucket, device: torch.device, slot: int) -> torch.Tensor:
        """The bucket's payload: its own memory when its tensors already lie there back to back, in
        order (a run of the model's parameters, iter_buckets; a lone tensor), never a copy then; else
        copied into flat buffer `slot`, grown when the bucket is larger. A bucket larger than the buffer
        sent from its own memory takes the buffer's place (the buffer is dropped, not grown), so the
        sender never holds more than with the copy."""
        buffer = self._buffers[slot]
        own = bucket.in_place(device)
        if own is not None:
            if buffer is not None and bucket.nbytes > buffer.numel():
                self._buffers[slot] = None
            return own   # never kept as a buffer: the next flatten must not write the model
        flat = await asyncio.to_thread(pinned, device, bucket.flatten, device, buffer)
        if buffer is None or flat.numel() > buffer.numel():
            self._buffers[slot] = flat
        return flat

    def _start_bucket(self, bucket: Bucket, flat: torch.Tensor, version: int, label: str, wire: SerialThread,
                      previous: Optional[asyncio.Future]) -> tuple:
        """Bucket `label` in flight: (the sender's broadcast, queued behind the previous bucket's in the
        wire thread; the whole bucket, its engine calls issued once the `previous` bucket is done)."""
        sent = wire.submit(pinned, flat.device, broadcast_flat, flat, self.group)
        return sent, asyncio.ensure_future(self.send_flat(bucket, flat, version, label, sent, after=previous))

    async def send_flat(self, bucket: Bucket, flat: torch.Tensor, version: int, label: str = "bucket",
                        wire: Optional[asyncio.Future] = None, after: Optional[asyncio.Future] = None) -> None:
        """One bucket: every engine's update call concurrently with the sender's broadcast of `flat`
        (`wire`, when it was started already), the calls once `after` (the bucket before) is done.
        An engine that refuses (HTTP 400) fails the bucket at once, naming it; the sender's broadcast,
        blocked on that engine, is left to the group timeout in its daemon thread."""
        if after is not None:
            await after
        names, dtypes, shapes = bucket.meta()
        calls = self._each(lambda e: e.update_weights_from_distributed(
            names, dtypes, shapes, self.group_name, version, flattened_bucket=True, flush_cache=False))
        calls[SENDER] = wire if wire is not None else in_daemon_thread(pinned, flat.device, broadcast_flat, flat,
                                                                       self.group)
        what = f"weights {label} ({len(names)} tensors, {flat.numel()} bytes, version {version})"
        try:
            await run_all(calls, what, self.cfg.timeout_s)
        except EngineError as err:
            raise await self._blame(err, what) from err
        self.bytes_sent += flat.numel()

    async def _blame(self, err: EngineError, what: str) -> EngineError:
        """When only the sender's collective failed (gloo sees the peer's socket close before the dead
        engine's HTTP call fails), probe every engine (/model_info: it answers while paused) to name
        the one that died."""
        if not isinstance(err, PushError) or err.parties != [SENDER]:
            return err
        probe = min(10.0, self.cfg.timeout_s)
        replies = await asyncio.gather(*(asyncio.wait_for(e.reachable(), probe) for e in self.engines),
                                       return_exceptions=True)
        dead = [e.name for e, ok in zip(self.engines, replies) if ok is not True]
        if not dead:
            return err
        return PushError(f"engine {', '.join(dead)}: {what} failed: the engine is unreachable "
                          f"(the broadcast broke: {err})", [f"engine {n}" for n in dead])

    async def close(self) -> None:
        if self.group is None:
            return
        await run_all(self._each(lambda e: e.destroy_weights_update_group(self.group_name)),
                      "destroy_weights_update_group", self.cfg.timeout_s)
        import torch.distributed as dist

        dist.destroy_process_group(self.group)
        self.group = None
