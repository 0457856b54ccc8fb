"""WeightSync: push the trainer's HF-named weights to every rollout engine under a weight version.

Seam: `WeightSync.push(named_tensors, version)` (async), built by `build_weight_sync(cfg, engines)`.
- BroadcastWeightSync: one process group spanning the sender (rank 0) and every engine's TP ranks
  (engine i joins with rank_offset = 1 + the TP sizes of the engines before it; SGLang adds its
  tp_rank). Flattened buckets of cfg.bucket_mb, non-expert tensors before expert ones; per bucket
  the engines' /update_weights_from_distributed calls run concurrently with the sender's broadcast.
  nccl with CUDA, gloo otherwise.
- DiskWeightSync: write HF safetensors shards, then /update_weights_from_disk on every engine.
- FP8 engines (rollout.engine_fp8, `fp8=Fp8Layout`): the tensors the engine holds in FP8 go as
  float8_e4m3fn 128x128 blocks followed by their float32 `<name>_scale_inv` (fp8_blocks.py), every
  other tensor as exported; a scale stays next to its weight in the stream and in one bucket. Over
  gloo they travel inside the flattened uint8 payload (gloo's broadcast refuses float8 tensors:
  "Invalid scalar type"); SGLang's receiver views its bucket as float8 (weight_sync/tensor_bucket.py).

The update window (docs/weights.md) has one owner, the driver rank of the trainer
(sao_megatron/trainer/weight_updates.py): the rollout driver pauses the engines (RolloutDriver.weight_update),
`update_session()` opens the engines' weight-update session (broadcast only: SGLang 0.5.23 refuses
distributed updates outside one), every stage's sender pushes, the session closes, and the driver
settles each prefix cache (rollout.engine.settle_prefix_cache) and resumes. `push` itself never
pauses or resumes, so with per-stage senders (pp > 1) each engine gets ONE pause and ONE session
around every stage's push. `settle_caches` settles idle engines when nothing was paused (at resume).
Nothing here calls /health (it generates a token, and waits while the engines are paused): liveness
is /model_info (`WeightReceiver.reachable`).
Every step runs under cfg.timeout_s; a failing or silent engine raises EngineError naming it.

Pipeline parallelism (weight_sync.senders): with `per_stage` (the default) each stage's first rank
exports only its stage's tensors (RLModel.export_hf(scope="stage")) and sends them through its own
BroadcastWeightSync(stage=s) on its own group `sao_weights_pp<s>_...` with the engines (engines join
one group per stage; SGLang keeps several named groups); with `driver` every stage gathers to rank 0,
the one sender.
"""
from __future__ import annotations

import abc
import asyncio
import contextlib
import shutil
import socket
import uuid
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from checkpoints.name_map import is_expert_hf_name
from rollout.engine import EngineError, Generator, settle_prefix_cache
from sao_megatron.core.backends import resolve_backend
from sao_megatron.core.ports import free_port

from .buckets import Bucket, broadcast_flat, create_sender_group, iter_buckets, mla_a_pairs
from .fp8_blocks import SCALE_SUFFIX, Fp8Layout, quantize_stream
from .calls import in_daemon_thread, payload_device, pinned, run_all, step_error
from .receiver import WeightReceiver

__all__ = ["WeightSync", "BroadcastWeightSync", "DiskWeightSync", "build_weight_sync", "settle_caches",
           "non_expert_first", "sender_address", "run_all", "in_daemon_thread"]

SENDER = "trainer sender (rank 0)"
SESSION_CLOSE_AFTER_FAILURE_S = 10.0   # closing the session after a failure must not hold up the error


class WeightSync(abc.ABC):
    @abc.abstractmethod
    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Make every engine serve exactly these tensors, labelled `version`."""

    @contextlib.asynccontextmanager
    async def update_session(self):
        """The engines' weight-update session around one push (none for this transport)."""
        yield

    async def close(self) -> None:
        """Release the transport (process group, files)."""

    def regroup(self) -> None:
        """An engine process was replaced (a restart): the next push forms its group(s) anew, since the
        new process is in none of the old ones. Nothing to do for a transport without a group."""


def sender_address(engines: list[WeightReceiver]) -> str:
    """The address engines reach this sender at: loopback when every engine is local, else the
    address of the interface that routes to the first remote engine (SAO_WEIGHT_SYNC_ADDR overrides)."""
    import os
    from urllib.parse import urlparse

    if os.environ.get("SAO_WEIGHT_SYNC_ADDR"):
        return os.environ["SAO_WEIGHT_SYNC_ADDR"]
    hosts = [urlparse(getattr(e, "url", "")).hostname or "127.0.0.1" for e in engines]
    remote = [h for h in hosts if h not in ("127.0.0.1", "localhost", "::1")]
    if not remote:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:   # connect() on UDP sends nothing
            probe.connect((remote[0], 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _cast(named: Iterable[tuple], dtype: Optional[torch.dtype]):
    """Each (name, tensor[, share]) with the tensor cast to `dtype`; a holder's share passes along."""
    for name, tensor, *share in named:
        yield name, (tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)), *share


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


async def _require_reachable(engine: WeightReceiver) -> None:
    if not await engine.reachable():
        raise EngineError(f"engine {engine.name}: does not answer /model_info (is the server up?)")


async def _begin_session(engine: WeightReceiver) -> None:
    """begin_weight_update; when refused, close a session a failed earlier push left open and retry."""
    try:
        await engine.begin_weight_update()
    except EngineError:
        with contextlib.suppress(EngineError):
            await engine.end_weight_update()
        await engine.begin_weight_update()


async def settle_caches(engines: list[Generator], version: int, flush: bool, timeout_s: float) -> None:
    """settle_prefix_cache on every engine: the update window's last step for engines nobody paused
    (at resume, before the driver starts); the driver's window settles the engines it paused."""
    await run_all({f"engine {e.name}": settle_prefix_cache(e, version, flush) for e in engines},
                  "prefix cache settle", timeout_s)


class _EngineSync(WeightSync):
    """What both transports share: the engines, the liveness check, the dtype cast and, for FP8 engines
    (`fp8`: rollout.engine_fp8), the block-FP8 quantization of the tensors they hold in FP8
    (fp8_blocks.py); `_transfer` differs. The caller holds the update window (pause, session, settle,
    continue) around `push`."""

    def __init__(self, cfg, engines: list[WeightReceiver], dtype: Optional[torch.dtype] = None,
                 fp8: Optional[Fp8Layout] = None):
        if not engines:
            raise ValueError("weight_sync: no engines to update; fix: start engines or set rollout.engine_urls")
        self.cfg, self.engines, self.dtype, self.fp8 = cfg, list(engines), dtype, fp8

    def _each(self, fn) -> dict[str, asyncio.Future]:
        return {f"engine {e.name}": fn(e) for e in self.engines}

    async def push(self, named_tensors, version: int) -> None:
        await run_all(self._each(_require_reachable), "liveness check (/model_info)", self.cfg.timeout_s)
        named = mla_a_pairs(_cast(named_tensors, self.dtype))   # SGLang fuses them within one call
        await self._transfer(named if self.fp8 is None else quantize_stream(named, self.fp8), version)

    @abc.abstractmethod
    async def _transfer(self, named_tensors, version: int) -> None: ...


def _engine_ranks(ranks_per_engine: int | Sequence[int], engines: int) -> list[int]:
    ranks = [ranks_per_engine] * engines if isinstance(ranks_per_engine, int) else list(ranks_per_engine)
    if len(ranks) != engines or any(not isinstance(r, int) or r < 1 for r in ranks):
        raise ValueError(f"ranks_per_engine {ranks_per_engine!r} must be one int >= 1 or one per engine "
                         f"({engines}); fix: pass each engine's TP size (rollout.engine_tp)")
    return ranks


class _SessionSync(_EngineSync):
    """A transport whose engines load inside SGLang's weight-update session (broadcast, shard writes)."""

    @contextlib.asynccontextmanager
    async def update_session(self):
        """One weight-update session per engine around a push; closed when the push fails too (at most
        SESSION_CLOSE_AFTER_FAILURE_S, then left to the next push's begin, which recovers it)."""
        t = self.cfg.timeout_s
        await run_all(self._each(_begin_session), "begin_weight_update", t)
        try:
            yield
        except BaseException:
            with contextlib.suppress(EngineError):
                await run_all(self._each(lambda e: e.end_weight_update()), "end_weight_update",
                              min(SESSION_CLOSE_AFTER_FAILURE_S, t))
            raise
        await run_all(self._each(lambda e: e.end_weight_update()), "end_weight_update", t)


class BroadcastWeightSync(_SessionSync):
    def __init__(self, cfg, engines: list[WeightReceiver], *, ranks_per_engine: int | Sequence[int] = 1,
                 master_address: Optional[str] = None, stage: int = 0, dtype: Optional[torch.dtype] = None,
                 fp8: Optional[Fp8Layout] = None):
        super().__init__(cfg, engines, dtype, fp8)
        self.engine_ranks, self.stage = _engine_ranks(ranks_per_engine, len(self.engines)), stage
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
        """Send the buckets in order; bucket i+1 is flattened (into the other of two reused buffers) while
        bucket i is on the wire, so the copy hides behind the transfer. The payload device is captured
        here, in the caller's thread, and made current in the flatten and broadcast threads."""
        await self.connect()
        device = payload_device(self.backend)
        bucket_bytes = int(self.cfg.bucket_mb * 2**20)
        buffers, in_flight = self._buffers, None
        try:
            for i, bucket in enumerate(iter_buckets(non_expert_first(named_tensors, bucket_bytes), bucket_bytes)):
                flat = await asyncio.to_thread(pinned, device, bucket.flatten, device, buffers[i % 2])
                bucket.release()
                if buffers[i % 2] is None or flat.numel() > buffers[i % 2].numel():
                    buffers[i % 2] = flat
                if in_flight is not None:
                    await in_flight
                in_flight = asyncio.ensure_future(self.send_flat(bucket, flat, version, f"bucket {i}"))
            if in_flight is not None:
                await in_flight
        except BaseException:
            if in_flight is not None and not in_flight.done():
                in_flight.cancel()
            self.group = None  # a failed collective leaves the group unusable: rebuild on the next push
            raise

    async def send_flat(self, bucket: Bucket, flat: torch.Tensor, version: int, label: str = "bucket") -> None:
        """One bucket: every engine's update call concurrently with the sender's broadcast of `flat`.
        An engine that refuses (HTTP 400) fails the bucket at once, naming it; the sender's broadcast,
        blocked on that engine, is left to the group timeout in its daemon thread."""
        names, dtypes, shapes = bucket.meta()
        calls = self._each(lambda e: e.update_weights_from_distributed(
            names, dtypes, shapes, self.group_name, version, flattened_bucket=True, flush_cache=False))
        calls[SENDER] = in_daemon_thread(pinned, flat.device, broadcast_flat, flat, self.group)
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
        if getattr(err, "parties", None) != [SENDER]:
            return err
        probe = min(10.0, self.cfg.timeout_s)
        replies = await asyncio.gather(*(asyncio.wait_for(e.reachable(), probe) for e in self.engines),
                                       return_exceptions=True)
        dead = [e.name for e, ok in zip(self.engines, replies) if ok is not True]
        if not dead:
            return err
        return step_error(f"engine {', '.join(dead)}: {what} failed: the engine is unreachable "
                          f"(the broadcast broke: {err})", [f"engine {n}" for n in dead])

    async def close(self) -> None:
        if self.group is None:
            return
        await run_all(self._each(lambda e: e.destroy_weights_update_group(self.group_name)),
                      "destroy_weights_update_group", self.cfg.timeout_s)
        import torch.distributed as dist

        dist.destroy_process_group(self.group)
        self.group = None


class DiskWeightSync(_EngineSync):
    """HF shards under disk_dir/v<version>, loaded by every engine; older versions are deleted.
    Shards of weight_sync.bucket_mb (a larger tensor alone): the sender holds one shard at a time
    (weight_sync.max_sender_mb counts it, sender_budget.py).
    No session (SGLang's disk load needs none, and end_weight_update after it would post-process the
    loaded weights a second time); flush_cache=False, the window settles the cache."""

    def __init__(self, cfg, engines: list[WeightReceiver], disk_dir: str | Path, *,
                 aux_from: str | Path | None = None, dtype: Optional[torch.dtype] = None, keep: int = 1,
                 fp8: Optional[Fp8Layout] = None):
        super().__init__(cfg, engines, dtype, fp8)
        self.disk_dir, self.aux_from, self.keep = Path(disk_dir), aux_from, keep

    async def _transfer(self, named_tensors, version: int) -> None:
        from checkpoints.hf_io import save_hf_checkpoint

        path = self.disk_dir / f"v{version}"
        await asyncio.to_thread(save_hf_checkpoint, path, named_tensors, self.aux_from, self.cfg.bucket_mb)
        await run_all(self._each(lambda e: e.update_weights_from_disk(str(path), version, flush_cache=False)),
                      f"update_weights_from_disk({path})", self.cfg.timeout_s)
        old = sorted((p for p in self.disk_dir.glob("v*") if p != path and p.name[1:].isdigit()),
                     key=lambda p: int(p.name[1:]))
        for stale in old[: max(len(old) - (self.keep - 1), 0)]:
            shutil.rmtree(stale, ignore_errors=True)


def build_weight_sync(cfg, engines: list[WeightReceiver], run_dir: str | Path | None = None, *,
                      ranks_per_engine: int | Sequence[int] = 1, **kwargs) -> WeightSync:
    """The WeightSync named by cfg.method ("broadcast" | "disk"); kwargs go to its constructor.
    `ranks_per_engine` (each engine's TP size) shapes the broadcast group; disk needs no group."""
    if cfg.method == "broadcast":
        return BroadcastWeightSync(cfg, engines, ranks_per_engine=ranks_per_engine, **kwargs)
    if cfg.method == "shard_writes":
        from .sharded import ShardWriteSync

        kwargs.pop("stage", None)   # one sender per owning rank, whatever the stage (trainer/weight_updates.py)
        if kwargs.pop("fp8", None) is not None:   # the recipe check refuses it first (trainer/engines.py)
            raise ValueError("weight_sync.method = 'shard_writes' does not slice FP8 blocks and their scales per "
                             "rank; fix: use weight_sync.method = 'broadcast' with rollout.engine_fp8")
        return ShardWriteSync(cfg, engines, ranks_per_engine=ranks_per_engine, **kwargs)
    if cfg.method == "disk":
        disk_dir = cfg.disk_dir or (Path(run_dir) / "weights" if run_dir is not None else "")
        if not disk_dir:
            raise ValueError("weight_sync.disk_dir is empty and no run_dir was given; fix: set weight_sync.disk_dir")
        return DiskWeightSync(cfg, engines, disk_dir, **kwargs)
    raise ValueError(f"weight_sync.method {cfg.method!r} unknown; fix: use 'broadcast', 'shard_writes' or 'disk'")

