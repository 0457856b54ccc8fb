"""LoopbackEngine: a WeightReceiver (the weight protocol and nothing else), run in a local child process.

It joins weight-update groups (several, by name) and receives flattened buckets exactly as an SGLang
rank does (docs/engines.md), only inside a begin/end_weight_update session as SGLang 0.5.23 requires,
keeps the tensors it received, and answers get_weights_by_name. It serves no
generation. Uses: the weight-sync benchmark (bench/weight_sync.py, which also needs `receive_raw`
for its baseline) and transport tests. The child is a separate process because gloo's group
constructor holds the GIL: a sender and a receiver cannot share one process.
"""
from __future__ import annotations

import asyncio
import datetime
import math
import multiprocessing as mp
import torch

from rollout.engines.engine import EngineError

from .buckets import ReceiveBuffer
from .receiver import WeightReceiver


def _child(conn) -> None:
    """Command loop: (op, args) -> ("ok", result) | ("error", message); ends on "exit"."""
    torch.set_num_threads(1)
    # groups by name, as SGLang keeps them; one receive buffer reused by every bucket and raw broadcast
    state = {"weights": {}, "version": 0, "group": None, "groups": {}, "buffer": ReceiveBuffer()}
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

    timeout = datetime.timedelta(seconds=state.get("timeout_s", 600))
    store, rank, world = next(c10d.rendezvous(f"tcp://{addr}:{port}", rank, world, timeout=timeout))
    group, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(backend),
                                              c10d.PrefixStore(group_name, store), group_name=group_name,
                                              timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    state["group"] = state["groups"][group_name] = group


def _receive(state, names, dtypes, shapes, version, keep, group_name):
    """One flattened bucket into the reused buffer; kept as copies (the next bucket overwrites it)."""
    dts = [getattr(torch, d) for d in dtypes]
    sizes = [math.prod(s) * d.itemsize for d, s in zip(dts, shapes)]
    flat = state["buffer"].take(sum(sizes))
    torch.distributed.broadcast(flat, src=0, group=state["groups"][group_name])
    offset = 0
    for name, dt, shape, size in zip(names, dts, shapes, sizes) if keep else ():
        state["weights"][name] = flat[offset:offset + size].view(dt).reshape(shape).clone()
        offset += size
    state["version"] = version


def _receive_raw(state, nbytes, chunk, group_name=None):
    flat = state["buffer"].take(nbytes)
    group = state["group"] if group_name is None else state["groups"][group_name]
    for start in range(0, nbytes, chunk):
        torch.distributed.broadcast(flat[start:start + chunk], src=0, group=group)


def _destroy(state, group_name):
    group = state["groups"].pop(group_name, None)
    if group is not None:
        torch.distributed.destroy_process_group(group)
    if state["group"] is group:
        state["group"] = None


def _load_disk(state, path, version):
    from checkpoints.hf_io import HFCheckpoint

    state["weights"].update(dict(HFCheckpoint(path)))
    state["version"] = version


def _checksums(weights: dict) -> dict:
    from rollout.weights.checksum import tensor_checksum

    return {name: tensor_checksum(t) for name, t in weights.items()}


class _CountingTarget:
    """A loopback TP rank's shard-write target: checks each bucket's sizes and keeps nothing (bench)."""

    def __init__(self, rank: int):
        self.rank = rank

    def apply(self, meta: dict, payload: torch.Tensor) -> None:
        sizes = [math.prod(s) * getattr(torch, d).itemsize for d, s in zip(meta["dtypes"], meta["shapes"])]
        if sum(sizes) != payload.numel():
            raise ValueError(f"bucket payload has {payload.numel()} bytes, its names account for {sum(sizes)}")


def _shard_join(state, entry, address, backend):
    from .shard_wire import join_and_serve

    state["groups"][entry["group_name"]] = join_and_serve(entry, address, _CountingTarget(entry["tp_rank"]),
                                                          backend, state.get("timeout_s", 600))


def _receive_p2p(state, group_name, sizes):
    """The raw baseline of shard writes: plain receives of these sizes from group rank 0."""
    for size in sizes:
        torch.distributed.recv(state["buffer"].take(size), src=0, group=state["groups"][group_name])


_OPS = {"join": _join, "shard_join": _shard_join, "receive_p2p": _receive_p2p, "receive": _receive,
        "receive_raw": _receive_raw, "destroy": _destroy, "load_disk": _load_disk,
        "get": lambda state, name: state["weights"][name],
        "set": lambda state, name, t: state["weights"].__setitem__(name, t),
        "version": lambda state: state["version"], "exit": lambda state: None,
        "checksums": lambda state: _checksums(state["weights"])}


class LoopbackEngine(WeightReceiver):
    def __init__(self, name: str, reply_timeout_s: float = 600.0, keep_weights: bool = True):
        self.name, self.reply_timeout_s, self.keep_weights = name, reply_timeout_s, keep_weights
        self.calls: list[str] = []
        self.rank = -1
        self.session_open = False   # SGLang's weight-update session (begin/end_weight_update)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child,), daemon=True, name=f"loopback-{name}")
        self._proc.start()
        self._lock = asyncio.Lock()

    async def _rpc(self, op: str, *args):
        async with self._lock:      # one command at a time on the pipe
            self._conn.send((op, args))
            if not await self._readable():
                raise EngineError(f"engine {self.name}: {op} got no reply within {self.reply_timeout_s:.0f}s")
            status, payload = self._conn.recv()
        if status == "error":
            raise EngineError(f"engine {self.name}: {op}: {payload}")
        return payload

    async def _readable(self) -> bool:
        """Wait for the child's reply on the event loop itself (no worker thread to wake up and hand the
        reply over: a bucket's call is on the weight sync's critical path). False after reply_timeout_s."""
        loop, fd = asyncio.get_running_loop(), self._conn.fileno()
        ready = loop.create_future()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(True))
        try:
            return await asyncio.wait_for(ready, self.reply_timeout_s)
        except asyncio.TimeoutError:
            return False
        finally:
            loop.remove_reader(fd)

    def _note(self, what: str) -> None:
        """Record a control call (hook for fault injection in tests)."""
        self.calls.append(what)

    async def weight_version(self) -> int:
        self._note("model_info")
        if not self._proc.is_alive():
            raise EngineError(f"engine {self.name}: receiver process exited with code {self._proc.exitcode}")
        return await self._rpc("version")

    async def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                        backend):
        self._note("init_weights_update_group")
        self.rank = rank_offset
        await self._rpc("join", master_address, master_port, rank_offset, world_size, group_name, backend)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        self._note("destroy_weights_update_group")
        await self._rpc("destroy", group_name)

    async def begin_weight_update(self) -> None:
        self._note("begin_weight_update")
        if self.session_open:
            raise EngineError(f"engine {self.name}: /begin_weight_update failed: a weight-update session is "
                              "already open")
        self.session_open = True

    async def end_weight_update(self) -> None:
        self._note("end_weight_update")
        if not self.session_open:
            raise EngineError(f"engine {self.name}: /end_weight_update failed: no weight-update session is open")
        self.session_open = False

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name, weight_version,
                                              flattened_bucket=True, flush_cache=True) -> None:
        self._note("update_weights_from_distributed")
        if not self.session_open:   # refused at once, before joining the broadcast, as SGLang 0.5.23 does
            raise EngineError(f"engine {self.name}: /update_weights_from_distributed failed: must run between "
                              "begin_weight_update() and end_weight_update()")
        if not flattened_bucket:
            raise EngineError(f"engine {self.name}: LoopbackEngine receives flattened buckets only")
        await self._rpc("receive", list(names), [str(d).removeprefix("torch.") for d in dtypes],
                        [list(s) for s in shapes], weight_version, self.keep_weights, group_name)

    async def receive_raw(self, nbytes: int, chunk: int = 0, group_name: str | None = None) -> None:
        """Take part in plain broadcasts of `nbytes` uint8 from rank 0, in slices of `chunk` bytes
        (0 = one broadcast), on `group_name` (default: the last group joined): the benchmark's baseline."""
        await self._rpc("receive_raw", nbytes, chunk or nbytes, group_name)

    async def update_weights_from_disk(self, model_path: str, weight_version: int, flush_cache: bool = True) -> None:
        self._note("update_weights_from_disk")
        await self._rpc("load_disk", model_path, weight_version)

    async def get_weights_by_name(self, name: str) -> torch.Tensor:
        self._note("get_weights_by_name")
        return await self._rpc("get", name)

    async def check_weights(self, action: str = "checksum", skip_tensor_list=None, selector: str = "all"):
        """SGLang's /weights_checker "checksum" over the kept tensors (HF names), as one TP rank."""
        from rollout.weights.checksum import checksum_reply, is_skipped, parse_weights_checker_reply

        if action != "checksum":
            raise EngineError(f"engine {self.name}: LoopbackEngine answers action 'checksum' only, not {action!r}")
        sums = await self._rpc("checksums")
        return parse_weights_checker_reply(checksum_reply(
            [{n: h for n, h in sums.items() if not is_skipped(n, skip_tensor_list)}]))

    async def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        await self._rpc("set", name, tensor)

    async def close(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=10)


class LoopbackShardEngine(WeightReceiver):
    """An engine of `tp` TP ranks for shard writes (bench): rank r is a LoopbackEngine child that joins its
    lane's group and checks, then drops, the slices it receives. Also the raw baselines: plain
    broadcasts (`ranks[r].receive_raw`) and plain receives (`receive_p2p`) on groups of their own."""

    def __init__(self, name: str, tp: int, reply_timeout_s: float = 600.0):
        self.name, self.version, self.session_open = name, 0, False
        self.ranks = [LoopbackEngine(f"{name}/tp{r}", reply_timeout_s, keep_weights=False) for r in range(tp)]

    async def weight_version(self) -> int:
        await self.ranks[0].weight_version()   # liveness of rank 0's process
        return self.version

    async def update_weight_version(self, version: int) -> None:
        self.version = version

    async def begin_weight_update(self) -> None:
        self.session_open = True

    async def end_weight_update(self) -> None:
        self.session_open = False

    async def join_shard_groups(self, master_address: str, groups: list[dict]) -> None:
        await asyncio.gather(*(self.ranks[e["tp_rank"]]._rpc("shard_join", e, master_address, "gloo") for e in groups))

    async def destroy_shard_groups(self, group_names: list[str]) -> None:
        await asyncio.gather(*(r._rpc("destroy", n) for r in self.ranks for n in group_names))

    async def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                        backend):
        await asyncio.gather(*(r.init_weights_update_group(master_address, master_port, rank_offset + i, world_size,
                                                           group_name, backend) for i, r in enumerate(self.ranks)))

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await asyncio.gather(*(r.destroy_weights_update_group(group_name) for r in self.ranks))

    async def receive_p2p(self, rank: int, master_address: str, master_port: int, group_rank: int, world: int,
                          group_name: str, sizes: list[int], join: bool) -> None:
        if join:
            await self.ranks[rank]._rpc("join", master_address, master_port, group_rank, world, group_name, "gloo")
        await self.ranks[rank]._rpc("receive_p2p", group_name, sizes)

    async def update_weights_from_distributed(self, *args, **kwargs) -> None:
        raise EngineError(f"engine {self.name}: LoopbackShardEngine takes shard writes only")

    async def update_weights_from_disk(self, *args, **kwargs) -> None:
        raise EngineError(f"engine {self.name}: LoopbackShardEngine takes shard writes only")

    async def get_weights_by_name(self, name: str) -> torch.Tensor:
        raise EngineError(f"engine {self.name}: LoopbackShardEngine keeps no weights")

    async def close(self) -> None:
        for rank in self.ranks:
            await rank.close()
