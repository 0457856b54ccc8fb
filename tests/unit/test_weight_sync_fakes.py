"""A fake Engine for weight-sync tests: the receiving side runs in a spawned child process (gloo
constructors hold the GIL, so sender and receiver cannot share a process). Its receiver is written
from the protocol in docs/engines.md, independently of the reference server. `dead=True` makes every
call fail like a killed server's refused connection; `hang=True` makes a bucket receive never return.
"""
from __future__ import annotations

import asyncio
import datetime
import math
import multiprocessing as mp
from typing import Optional

import torch

from rollout.engine import Engine, EngineError, GenerateRequest, GenerateResult

REPLY_TIMEOUT_S = 120.0


def _child(conn) -> None:
    """Command loop of the fake engine's process: (op, args) -> ("ok", result) | ("error", message)."""
    state = {"weights": {}, "version": 0, "group": None}
    while True:
        op, args = conn.recv()
        try:
            conn.send(("ok", _OPS[op](state, *args)))
        except Exception as err:  # noqa: BLE001 - shipped back to the parent, which raises it
            conn.send(("error", f"{type(err).__name__}: {err}"))
        if op == "exit":
            return


def _join(state, addr, port, rank, world, group_name, backend):
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=60)
    store, rank, world = next(c10d.rendezvous(f"tcp://{addr}:{port}", rank, world, timeout=timeout))
    group, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store),
                                              group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    state["group"] = group


def _receive(state, names, dtypes, shapes, version):
    dts = [getattr(torch, d) for d in dtypes]
    sizes = [math.prod(s) * torch.empty((), dtype=d).element_size() for d, s in zip(dts, shapes)]
    flat = torch.empty(sum(sizes), dtype=torch.uint8)
    torch.distributed.broadcast(flat, src=0, group=state["group"])
    offset = 0
    for name, dt, shape, size in zip(names, dts, shapes, sizes):
        state["weights"][name] = flat[offset:offset + size].view(dt).reshape(shape).clone()
        offset += size
    state["version"] = version


def _destroy(state):
    torch.distributed.destroy_process_group(state["group"])
    state["group"] = None


def _load_disk(state, path, version):
    from checkpoints.hf_io import HFCheckpoint

    state["weights"].update(dict(HFCheckpoint(path)))
    state["version"] = version


_OPS = {"join": _join, "receive": _receive, "destroy": _destroy, "load_disk": _load_disk,
        "get": lambda state, name: state["weights"][name], "set": lambda state, name, t: state["weights"].__setitem__(name, t),
        "version": lambda state: state["version"], "exit": lambda state: None}


class FakeEngine(Engine):
    def __init__(self, name: str, dead: bool = False, hang: bool = False):
        self.name, self.dead, self.hang = name, dead, hang
        self.calls: list[str] = []
        self.rank = -1
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child,), daemon=True)
        self._proc.start()

    async def _rpc(self, op: str, *args):
        self._conn.send((op, args))
        ready = await asyncio.to_thread(self._conn.poll, REPLY_TIMEOUT_S)
        if not ready:
            raise EngineError(f"engine {self.name}: {op} got no reply within {REPLY_TIMEOUT_S:.0f}s")
        status, payload = self._conn.recv()
        if status == "error":
            raise EngineError(f"engine {self.name}: {op}: {payload}")
        return payload

    def _call(self, what: str) -> None:
        self.calls.append(what)
        if self.dead:
            raise EngineError(f"engine {self.name}: POST /{what}: connection refused")

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        raise NotImplementedError("FakeEngine does not generate")

    async def abort(self, rid: Optional[str] = None) -> None:
        self._call("abort_request")

    async def pause(self, mode: str = "in_place") -> None:
        self._call(f"pause_generation:{mode}")

    async def resume(self) -> None:
        self._call("continue_generation")

    async def flush_cache(self) -> None:
        self._call("flush_cache")

    async def health(self) -> bool:
        self._call("health")
        return True

    async def weight_version(self) -> int:
        return await self._rpc("version")

    async def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name, backend):
        self._call("init_weights_update_group")
        self.rank = rank_offset
        await self._rpc("join", master_address, master_port, rank_offset, world_size, group_name, backend)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("destroy_weights_update_group")
        await self._rpc("destroy")

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name, weight_version,
                                              flattened_bucket=True, flush_cache=True) -> None:
        self._call("update_weights_from_distributed")
        if self.hang:
            await asyncio.Event().wait()
        await self._rpc("receive", names, dtypes, shapes, weight_version)

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        self._call("update_weights_from_disk")
        await self._rpc("load_disk", model_path, weight_version)

    async def get_weights_by_name(self, name: str) -> torch.Tensor:
        self._call("get_weights_by_name")
        return await self._rpc("get", name)

    async def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        await self._rpc("set", name, tensor)

    async def close(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=10)
