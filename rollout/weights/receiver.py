"""The weight-receiving role of a rollout server: what weight sync needs from it.

`SGLangEngine` implements it over SGLang's HTTP protocol (docs/engines.md), beside the generation role
(`rollout.engines.engine.Generator`); `LoopbackEngine` (loopback_engine.py) implements only this role. Every
call here answers while the engine is paused: the caller (the driver's update window) holds the pause.
"""
from __future__ import annotations

import abc
from typing import Optional

import torch

from rollout.engines.engine import EngineError


class WeightReceiver(abc.ABC):
    """One rollout server's weight intake. All calls are async and carry a timeout."""

    name: str

    @abc.abstractmethod
    async def weight_version(self) -> int:
        """The version the engine serves (SGLang's /model_info: it answers while paused)."""

    async def reachable(self) -> bool:
        """Liveness without generating (reads the weight version), so it answers while paused."""
        try:
            await self.weight_version()
        except (EngineError, OSError):
            return False
        return True

    @abc.abstractmethod
    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None: ...

    @abc.abstractmethod
    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    @abc.abstractmethod
    async def begin_weight_update(self) -> None:
        """Open the engine's weight-update session: SGLang 0.5.23 refuses update_weights_from_distributed
        outside one. Fails if a session is already open."""

    @abc.abstractmethod
    async def end_weight_update(self) -> None:
        """Close the session begin_weight_update opened. Fails if none is open."""

    @abc.abstractmethod
    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: int, flattened_bucket: bool = True,
                                              flush_cache: bool = True) -> None:
        """Receive one broadcast bucket; returns when the engine has loaded it."""

    @abc.abstractmethod
    async def update_weights_from_disk(self, model_path: str, weight_version: int, flush_cache: bool = True) -> None:
        """Load HF shards from `model_path`. SGLang refuses flush_cache=True while requests paused in
        place hold KV; weight sync sends False and the update window settles the cache
        (rollout.engines.engine.settle_prefix_cache)."""

    @abc.abstractmethod
    async def get_weights_by_name(self, name: str) -> torch.Tensor: ...

    async def check_weights(self, action: str = "checksum", skip_tensor_list: Optional[list[str]] = None,
                            selector: str = "all"):
        """SGLang's /weights_checker: an `EngineChecksums` (rollout/weights/checksum.py) holding every
        rank's {tensor name: checksum}. Not abstract: receivers that keep no weights need not answer."""
        raise EngineError(f"engine {self.name}: {type(self).__name__} does not implement check_weights")

    async def update_weight_version(self, version: int) -> None:
        """Label the weights the engine serves (SGLang's /update_weight_version, without aborting
        requests): the shard-writes transport writes weights without an update call that carries one."""
        raise EngineError(f"engine {self.name}: {type(self).__name__} does not implement update_weight_version")

    async def join_shard_groups(self, master_address: str, groups: list[dict]) -> None:
        """Shard writes (rollout/weights/shard_writes.py): each listed TP rank joins its sender's group. Not
        an SGLang route: only the reference server with --shard-writes answers it."""
        raise EngineError(f"engine {self.name}: {type(self).__name__} does not take shard writes")

    async def destroy_shard_groups(self, group_names: list[str]) -> None:
        raise EngineError(f"engine {self.name}: {type(self).__name__} does not take shard writes")

    async def close(self) -> None:
        """Release client resources (connections). The server itself keeps running."""
