"""What every weight-sync transport shares: the seam `WeightSync`, the engine-facing base classes and the
update window's engine calls (docs/weights.md, docs/weight-transports.md).

Seam: `WeightSync.push(named_tensors, version)` (async), built by factory.build_weight_sync. The update
window has one owner, the driver rank of the trainer (sao_megatron/trainer/weight_updates.py): the rollout
driver pauses the engines (RolloutDriver.weight_update), `update_session()` opens the engines'
weight-update session (broadcast and shard writes: SGLang 0.5.23 refuses distributed updates outside one),
every sender pushes, the session closes, and the driver settles each prefix cache
(rollout.engines.engine.settle_prefix_cache) and resumes. `push` itself never pauses or resumes, so with several
senders (per-stage, shares) each engine gets ONE pause and ONE session around every sender's push.
`settle_caches` settles idle engines when nothing was paused (at resume). Nothing here calls /health (it
generates a token, and waits while the engines are paused): liveness is /model_info
(`WeightReceiver.reachable`). Every step runs under cfg.timeout_s; a failing or silent engine raises
PushError naming it.
"""
from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
from typing import Iterable, Optional, Sequence

import torch

from rollout.engines.engine import EngineError, Generator, settle_prefix_cache

from .calls import run_all
from .fp8_blocks import Fp8Layout, quantize_stream
from .buckets import mla_a_pairs
from .receiver import WeightReceiver

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


def cast_to(named: Iterable[tuple], dtype: Optional[torch.dtype]):
    """Each (name, tensor[, share]) with the tensor cast to `dtype`; a holder's share passes along."""
    for name, tensor, *share in named:
        yield name, (tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)), *share


async def require_reachable(engine: WeightReceiver) -> None:
    if not await engine.reachable():
        raise EngineError(f"engine {engine.name}: does not answer /model_info (is the server up?)")


async def begin_session(engine: WeightReceiver) -> None:
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


class EngineSync(WeightSync):
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
        await run_all(self._each(require_reachable), "liveness check (/model_info)", self.cfg.timeout_s)
        named = mla_a_pairs(cast_to(named_tensors, self.dtype))   # SGLang fuses them within one call
        await self._transfer(named if self.fp8 is None else quantize_stream(named, self.fp8), version)

    @abc.abstractmethod
    async def _transfer(self, named_tensors, version: int) -> None: ...


def engine_ranks(ranks_per_engine: int | Sequence[int], engines: int) -> list[int]:
    ranks = [ranks_per_engine] * engines if isinstance(ranks_per_engine, int) else list(ranks_per_engine)
    if len(ranks) != engines or any(not isinstance(r, int) or r < 1 for r in ranks):
        raise ValueError(f"ranks_per_engine {ranks_per_engine!r} must be one int >= 1 or one per engine "
                         f"({engines}); fix: pass each engine's TP size (rollout.engine_tp)")
    return ranks


class SessionSync(EngineSync):
    """A transport whose engines load inside SGLang's weight-update session (broadcast, shard writes)."""

    @contextlib.asynccontextmanager
    async def update_session(self):
        """One weight-update session per engine around a push; closed when the push fails too (at most
        SESSION_CLOSE_AFTER_FAILURE_S, then left to the next push's begin, which recovers it)."""
        t = self.cfg.timeout_s
        await run_all(self._each(begin_session), "begin_weight_update", t)
        try:
            yield
        except BaseException:
            with contextlib.suppress(EngineError):
                await run_all(self._each(lambda e: e.end_weight_update()), "end_weight_update",
                              min(SESSION_CLOSE_AFTER_FAILURE_S, t))
            raise
        await run_all(self._each(lambda e: e.end_weight_update()), "end_weight_update", t)
