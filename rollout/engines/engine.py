"""The generation role of a rollout server: what the rollout driver and evaluation need from it.

A rollout server plays two roles, each a small interface:
- `Generator` (here): generate, abort, pause/resume, flush_cache, health, weight_version. The rollout
  driver (rollout/driver.py) and evaluation type against it.
- `WeightReceiver` (rollout/weights/receiver.py): weight-update sessions, groups, updates from a
  broadcast or from disk, check_weights. Weight sync (rollout/weights/) types against it.
`SGLangEngine` (rollout/engines/sglang_client.py) implements both over SGLang's HTTP protocol (docs/engines.md),
against a real SGLang server or our reference CPU server (`sao serve`); `ScriptedEngine`
(rollout/engines/scripted.py) implements both in process for tests and benches.

After a weight update, `settle_prefix_cache` is what the owner of the pause (the driver's update
window) calls before resuming the engines (docs/weights.md, "Prefix cache after an update").
"""
from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An engine failed or replied with something malformed. The message names the engine."""


@dataclass
class GenerateRequest:
    rid: str                                  # idempotent request id (the sample uid + attempt)
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    stop_token_ids: list[int] = field(default_factory=list)
    return_logprob: bool = True
    return_routed_experts: bool = True
    return_indexer_topk: bool = True          # sent only to an engine whose model has a DSA indexer


@dataclass
class GenerateResult:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float]              # logprob of each sampled token at the sampling temperature
    finish_reason: str                        # "stop" | "length" | "abort"
    weight_version: int                       # engine weight version when the request finished
    output_weight_versions: Optional[list[int]] = None  # per output token, when the engine reports it
    routed_experts: Optional[torch.Tensor] = None       # int32 [prompt+output-1, layers, topk]
    indexer_topk: Optional[torch.Tensor] = None         # int32 [prompt+output-1, layers, index_topk], -1 = none
    prompt_tokens: int = 0
    engine: str = ""


class Generator(abc.ABC):
    """One rollout server's generation side. All calls are async and carry a timeout."""

    name: str
    # Prefix-cache namespace every request carries (SGLang's `extra_key`): requests in different
    # namespaces never share cached KV. `settle_prefix_cache` sets it to the served weight version.
    cache_namespace: Optional[str] = None

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    @abc.abstractmethod
    async def abort(self, rid: Optional[str] = None) -> None:
        """Abort one request, or all with rid=None."""

    @abc.abstractmethod
    async def pause(self, mode: str = "in_place") -> None:
        """Stop scheduling: 'abort' ends running requests, 'retract' and 'in_place' keep them."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def flush_cache(self) -> None: ...

    @abc.abstractmethod
    async def health(self) -> bool:
        """Liveness through generation (SGLang's /health generates one token): never call it while
        the engine is paused, where it waits and then reports the engine unhealthy."""

    @abc.abstractmethod
    async def weight_version(self) -> int: ...

    async def close(self) -> None:
        """Release client resources (connections). The server itself keeps running."""


def cache_namespace(version: int) -> str:
    return f"sao-w{version}"


async def settle_prefix_cache(engine: Generator, version: int, flush: bool) -> bool:
    """After a weight update, before resuming: no request may reuse KV (or routes) computed under
    older weights. Returns whether the cache was flushed.

    - New requests go to `version`'s prefix-cache namespace: SGLang keeps radix-cache entries of
      different `extra_key`s disjoint (mem_cache/radix_cache.py match_prefix), so nothing cached
      under older weights is matched again, in every pause mode.
    - ``flush`` (pause modes abort and retract, or idle engines): no request holds KV (aborted, or
      retracted with its KV freed), so /flush_cache also frees the stale entries at once. With
      in_place the paused requests keep their KV in the running batch and SGLang refuses the flush
      (managers/scheduler.py flush_cache); their entries age out by LRU eviction instead. A refused
      flush is logged, not raised: the namespace already keeps the stale entries unused.
    """
    flushed = False
    if flush:
        try:
            await engine.flush_cache()
            flushed = True
        except EngineError as err:
            log.warning("engine %s: prefix cache not flushed after the update to version %d (%s); "
                        "its stale entries stay unused under the old namespace", engine.name, version, err)
    engine.cache_namespace = cache_namespace(version)
    return flushed
