"""WeightSync: push the trainer's HF-named weights to every rollout engine under a weight version.

Seam: `WeightSync.push(named_tensors, version)` (async), built by `build_weight_sync(cfg, engines)`.
- BroadcastWeightSync: one process group spanning the sender (rank 0) and every engine rank
  (engine i joins as rank 1 + i*ranks_per_engine); pause engines (cfg.pause_mode), flush their
  caches, send non-expert then expert tensors in flattened buckets of cfg.bucket_mb (each bucket: the
  engines' /update_weights_from_distributed calls run concurrently with the sender's broadcast), then
  continue the engines. nccl with CUDA, gloo otherwise.
- DiskWeightSync: write HF safetensors shards, then /update_weights_from_disk on every engine.
Every step runs under cfg.timeout_s; a failing or silent engine raises EngineError naming it.

Pipeline parallelism (weight_sync.senders): with `per_stage` (the default) each stage's first rank
exports only its stage's tensors (RLModel.export_hf(scope="stage")) and sends them through its own
BroadcastWeightSync(stage=s) on its own group `sao_weights_pp<s>_...` with the engines (engines join
one group per stage; SGLang keeps several named groups); with `driver` every stage gathers to rank 0,
the one sender. The trainer (sao_megatron/trainer/services.py) pauses and resumes the engines once
around all stages. See docs/weights.md.
"""
from __future__ import annotations

import abc
import asyncio
import shutil
import socket
import threading
import uuid
from pathlib import Path
from typing import Awaitable, Iterable, Optional

import torch

from rollout.engine import Engine, EngineError

from .name_map import is_expert_hf_name
from .weight_buckets import Bucket, create_sender_group, iter_buckets

SENDER = "trainer sender (rank 0)"


class WeightSync(abc.ABC):
    @abc.abstractmethod
    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Make every engine serve exactly these tensors, labelled `version`."""

    async def close(self) -> None:
        """Release the transport (process group, files)."""


async def run_all(calls: dict[str, Awaitable], what: str, timeout_s: float) -> list:
    """Await labelled calls together; the first failure or the timeout raises EngineError naming who."""
    if not calls:
        return []
    tasks = {asyncio.ensure_future(aw): label for label, aw in calls.items()}
    done, pending = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
    failed = [t for t in done if t.exception() is not None]
    for t in pending:
        t.cancel()
    if failed:
        label, err = tasks[failed[0]], failed[0].exception()
        raise _step_error(f"{label}: {what} failed: {type(err).__name__}: {err}", [label]) from err
    if pending:
        labels = sorted(tasks[t] for t in pending)
        raise _step_error(f"{', '.join(labels)}: {what} did not finish within {timeout_s:.0f}s (dead or hung engine?)",
                          labels)
    return [t.result() for t in tasks]


def _step_error(message: str, parties: list[str]) -> EngineError:
    err = EngineError(message)
    err.parties = parties   # who failed or is still waiting (labels of run_all's calls)
    return err


def in_daemon_thread(fn, *args) -> asyncio.Future:
    """Run a blocking collective off the event loop in a daemon thread. Unlike asyncio.to_thread, a
    collective stuck on a dead peer (it ends at the group timeout) never delays the loop's or the
    interpreter's shutdown; its outcome still reaches the awaiting coroutine."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def deliver(setter, value):
        if not future.done():
            setter(value)

    def work():
        try:
            result = fn(*args)
            outcome = (future.set_result, result)
        except BaseException as err:  # noqa: BLE001 - re-raised in the awaiting coroutine
            outcome = (future.set_exception, err)
        if not loop.is_closed():
            loop.call_soon_threadsafe(deliver, *outcome)

    threading.Thread(target=work, daemon=True, name=f"weight-sync-{getattr(fn, '__name__', 'call')}").start()
    return future


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def sender_address(engines: list[Engine]) -> str:
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _cast(named: Iterable[tuple[str, torch.Tensor]], dtype: Optional[torch.dtype]):
    for name, tensor in named:
        yield name, (tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype))


def non_expert_first(named: Iterable[tuple[str, torch.Tensor]]):
    """Stream non-expert tensors as they come and routed-expert tensors after them (slime's order).
    Expert tensors are held until the stream ends: pass a stream already in that order to hold none."""
    held = []
    for name, tensor in named:
        if is_expert_hf_name(name):
            held.append((name, tensor))
        else:
            yield name, tensor
    yield from held


async def _require_healthy(engine: Engine) -> None:
    if await engine.health() is not True:
        raise EngineError(f"engine {engine.name}: /health reports the engine unhealthy")


def _broadcast(flat: torch.Tensor, group) -> None:
    import torch.distributed as dist

    dist.broadcast(flat, src=0, group=group)


class _PausingSync(WeightSync):
    """Shared pause -> flush -> transfer -> continue frame of both implementations."""

    def __init__(self, cfg, engines: list[Engine], manage_pause: bool = True, dtype: Optional[torch.dtype] = None):
        if not engines:
            raise ValueError("weight_sync: no engines to update; fix: start engines or set rollout.engine_urls")
        self.cfg, self.engines, self.manage_pause, self.dtype = cfg, list(engines), manage_pause, dtype

    def _each(self, fn) -> dict[str, Awaitable]:
        return {f"engine {e.name}": fn(e) for e in self.engines}

    async def push(self, named_tensors, version: int) -> None:
        t = self.cfg.timeout_s
        await run_all(self._each(_require_healthy), "health check", t)
        if self.manage_pause:
            await run_all(self._each(lambda e: e.pause(self.cfg.pause_mode)), f"pause({self.cfg.pause_mode})", t)
            await run_all(self._each(lambda e: e.flush_cache()), "flush_cache", t)
        await self._transfer(_cast(named_tensors, self.dtype), version)
        if self.manage_pause:
            await run_all(self._each(lambda e: e.resume()), "continue_generation", t)

    @abc.abstractmethod
    async def _transfer(self, named_tensors, version: int) -> None: ...


class BroadcastWeightSync(_PausingSync):
    def __init__(self, cfg, engines: list[Engine], *, ranks_per_engine: int = 1, master_address: Optional[str] = None,
                 stage: int = 0, manage_pause: bool = True, dtype: Optional[torch.dtype] = None):
        super().__init__(cfg, engines, manage_pause, dtype)
        self.ranks_per_engine, self.stage = ranks_per_engine, stage
        self.master_address = master_address or sender_address(self.engines)
        self.backend = resolve_backend(cfg.backend)
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("weight_sync.backend = 'nccl' needs CUDA, and this process sees no GPU; "
                             "fix: set weight_sync.backend to 'gloo' or 'auto'")
        self.device = "cuda" if self.backend == "nccl" else "cpu"
        self.group, self.group_name = None, ""
        self.bytes_sent = 0
        self._buffers = [None, None]   # two reused flat payload buffers, grown to the largest bucket

    @property
    def world_size(self) -> int:
        return 1 + len(self.engines) * self.ranks_per_engine

    async def connect(self) -> None:
        """Form the weight-update group (sender rank 0 + every engine rank); idempotent."""
        if self.group is not None:
            return
        port, world = _free_port(), self.world_size
        name = f"sao_weights_pp{self.stage}_{uuid.uuid4().hex[:8]}"
        calls = {f"engine {e.name}": e.init_weights_update_group(
                     self.master_address, port, 1 + i * self.ranks_per_engine, world, name, self.backend)
                 for i, e in enumerate(self.engines)}
        calls[SENDER] = in_daemon_thread(create_sender_group, self.master_address, port, world, name,
                                          self.backend, self.cfg.timeout_s)
        results = await run_all(calls, f"joining weight-update group {name} (world {world}, {self.backend})",
                                self.cfg.timeout_s)
        self.group, self.group_name = results[-1], name

    async def _transfer(self, named_tensors, version: int) -> None:
        """Send the buckets in order; bucket i+1 is flattened (into the other of two reused buffers) while
        bucket i is on the wire, so the copy hides behind the transfer."""
        await self.connect()
        buffers, in_flight = self._buffers, None
        try:
            buckets = iter_buckets(non_expert_first(named_tensors), int(self.cfg.bucket_mb * 2**20))
            for i, bucket in enumerate(buckets):
                flat = await asyncio.to_thread(bucket.flatten, self.device, buffers[i % 2])
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
        """One bucket: every engine's update call concurrently with the sender's broadcast of `flat`."""
        names, dtypes, shapes = bucket.meta()
        calls = self._each(lambda e: e.update_weights_from_distributed(
            names, dtypes, shapes, self.group_name, version, flattened_bucket=True, flush_cache=False))
        calls[SENDER] = in_daemon_thread(_broadcast, flat, self.group)
        what = f"weights {label} ({len(names)} tensors, {flat.numel()} bytes, version {version})"
        try:
            await run_all(calls, what, self.cfg.timeout_s)
        except EngineError as err:
            raise await self._blame(err, what) from err
        self.bytes_sent += flat.numel()

    async def _blame(self, err: EngineError, what: str) -> EngineError:
        """When only the sender's collective failed (gloo sees the peer's socket close before the dead
        engine's HTTP call fails), probe every engine's health to name the one that died."""
        if getattr(err, "parties", None) != [SENDER]:
            return err
        probe = min(10.0, self.cfg.timeout_s)
        replies = await asyncio.gather(*(asyncio.wait_for(e.health(), probe) for e in self.engines),
                                       return_exceptions=True)
        dead = [e.name for e, ok in zip(self.engines, replies) if ok is not True]
        if not dead:
            return err
        return _step_error(f"engine {', '.join(dead)}: {what} failed: the engine is unreachable "
                           f"(the broadcast broke: {err})", [f"engine {n}" for n in dead])

    async def close(self) -> None:
        if self.group is None:
            return
        await run_all(self._each(lambda e: e.destroy_weights_update_group(self.group_name)),
                      "destroy_weights_update_group", self.cfg.timeout_s)
        import torch.distributed as dist

        dist.destroy_process_group(self.group)
        self.group = None


class DiskWeightSync(_PausingSync):
    """HF shards under disk_dir/v<version>, loaded by every engine; older versions are deleted."""

    def __init__(self, cfg, engines: list[Engine], disk_dir: str | Path, *, aux_from: str | Path | None = None,
                 manage_pause: bool = True, dtype: Optional[torch.dtype] = None, keep: int = 1):
        super().__init__(cfg, engines, manage_pause, dtype)
        self.disk_dir, self.aux_from, self.keep = Path(disk_dir), aux_from, keep

    async def _transfer(self, named_tensors, version: int) -> None:
        from .hf_io import save_hf_checkpoint

        path = self.disk_dir / f"v{version}"
        await asyncio.to_thread(save_hf_checkpoint, path, named_tensors, self.aux_from)
        await run_all(self._each(lambda e: e.update_weights_from_disk(str(path), version)),
                      f"update_weights_from_disk({path})", self.cfg.timeout_s)
        old = sorted((p for p in self.disk_dir.glob("v*") if p != path and p.name[1:].isdigit()),
                     key=lambda p: int(p.name[1:]))
        for stale in old[: max(len(old) - (self.keep - 1), 0)]:
            shutil.rmtree(stale, ignore_errors=True)


def build_weight_sync(cfg, engines: list[Engine], run_dir: str | Path | None = None, **kwargs) -> WeightSync:
    """The WeightSync named by cfg.method ("broadcast" | "disk"); kwargs go to its constructor."""
    if cfg.method == "broadcast":
        return BroadcastWeightSync(cfg, engines, **kwargs)
    if cfg.method == "disk":
        disk_dir = cfg.disk_dir or (Path(run_dir) / "weights" if run_dir is not None else "")
        if not disk_dir:
            raise ValueError("weight_sync.disk_dir is empty and no run_dir was given; fix: set weight_sync.disk_dir")
        return DiskWeightSync(cfg, engines, disk_dir, **kwargs)
    raise ValueError(f"weight_sync.method {cfg.method!r} unknown; fix: use 'broadcast' or 'disk'")


class WeightMismatchError(AssertionError):
    """An engine serves a tensor that differs from the trainer's."""


async def check_weight_update_equal(engines: list[Engine], named_tensors: Iterable[tuple[str, torch.Tensor]],
                                    timeout_s: float = 120.0) -> int:
    """Compare every engine's tensor (/get_weights_by_name) with the trainer's, bit for bit (after casting
    the trainer tensor to the engine's dtype). Returns the number of tensors checked; raises
    WeightMismatchError naming the engine and tensor of the first difference."""
    checked = 0
    for name, expected in named_tensors:
        got = await run_all({f"engine {e.name}": e.get_weights_by_name(name) for e in engines},
                            f"get_weights_by_name({name})", timeout_s)
        for engine, tensor in zip(engines, got):
            _compare(engine.name, name, expected, tensor)
        checked += 1
    return checked


def _compare(engine: str, name: str, expected: torch.Tensor, got: torch.Tensor) -> None:
    got = got.detach().cpu()
    if tuple(got.shape) != tuple(expected.shape):
        raise WeightMismatchError(f"engine {engine}: {name} has shape {tuple(got.shape)}, "
                                  f"trainer {tuple(expected.shape)}")
    want = expected.detach().cpu().to(got.dtype)
    if not torch.equal(got, want):
        delta = (got.double() - want.double()).abs()
        raise WeightMismatchError(f"engine {engine}: {name} differs from the trainer in {int((delta > 0).sum())} "
                                  f"of {delta.numel()} entries (max |delta| {delta.max().item():.3g})")
