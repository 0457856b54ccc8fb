"""The Engine seam: what the trainer and the rollout driver need from a rollout server.

Two implementations speak SGLang's HTTP protocol (docs/engines.md): `SGLangEngine` against a real
SGLang server, and the same client against our reference CPU server (`sao serve`). Anything that
talks to an engine goes through this interface, so tests can also use an in-process fake.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Optional

import torch


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


@dataclass
class GenerateResult:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float]              # logprob of each sampled token at the sampling temperature
    finish_reason: str                        # "stop" | "length" | "abort"
    weight_version: int                       # engine weight version when the request finished
    output_weight_versions: Optional[list[int]] = None  # per output token, when the engine reports it
    routed_experts: Optional[torch.Tensor] = None       # int32 [prompt+output-1, layers, topk]
    prompt_tokens: int = 0
    engine: str = ""


class Engine(abc.ABC):
    """One rollout server. All calls are async and carry a timeout."""

    name: str

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
    async def health(self) -> bool: ...

    @abc.abstractmethod
    async def weight_version(self) -> int: ...

    @abc.abstractmethod
    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None: ...

    @abc.abstractmethod
    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    @abc.abstractmethod
    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: int, flattened_bucket: bool = True,
                                              flush_cache: bool = True) -> None:
        """Receive one broadcast bucket; returns when the engine has loaded it."""

    @abc.abstractmethod
    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None: ...

    @abc.abstractmethod
    async def get_weights_by_name(self, name: str) -> torch.Tensor: ...

    async def close(self) -> None:
        """Release client resources (connections). The server itself keeps running."""
