"""Shard writes (opt-in, `sao serve --tp N --shard-writes`): each TP rank receives only its own slice.

What it stands in for: SGLang 0.5.23 lets a process outside the engine write straight into each TP
rank's own weights only through its Mooncake transfer engine (a server started with
--remote-instance-weight-loader-start-seed-via-transfer-engine registers every parameter and
publishes, per rank, {name: (address, numel, element size)} at /remote_instance_transfer_engine_info;
end_weight_update then runs the post-load step because no load ran in the session). There is no
SGLang route that receives a per-rank stream over a process group, so nothing here is SGLang's
protocol: the routes are named `/sao_*`, and the default broadcast path is untouched.

How the reference server plays it: the model stays whole in the server process; with --tp N its
parameters move to shared memory and TP ranks 1..N-1 (child processes, tp_ranks.py) attach to them.
Each rank joins the group of the trainer sender that serves it and runs a passive loop
(rollout/weights/shard_wire.py) that writes every slice it receives into its part of the weights
(rollout/weights/shard_plan.py: the slice TP rank r holds); tensors every rank holds whole are
written by every rank, with the same bytes. A rank refuses a slice whose name, dtype or shape is not
its own and reports the first refusal, and the bytes it received, in its ack.
"""
from __future__ import annotations

import torch

from rollout.weights.shard_plan import rank_slice
from rollout.weights.shard_wire import join_and_serve

from .weights import WeightMap, parse_dtype

class _NamedWeights(WeightMap):
    """A WeightMap over a dict of tensors (a TP-rank child has the shared tensors, not the model)."""

    def __init__(self, params: dict[str, torch.Tensor]):   # noqa: D107 - no model to walk
        self.model, self.params = None, dict(params)


class ShardTarget:
    """TP rank `rank` of `tp`: writes the slices it receives into its part of the served weights."""

    def __init__(self, params: dict[str, torch.Tensor], tp: int, rank: int):
        self.weights, self.tp, self.rank = _NamedWeights(params), tp, rank

    def own_part(self, name: str) -> torch.Tensor:
        full = self.weights.resolve(name)
        cut = rank_slice(name, tuple(full.shape), self.tp, self.rank)
        return full if cut is None else full.narrow(*cut)

    def apply(self, meta: dict, payload: torch.Tensor) -> None:
        """Write one bucket; ValueError (or UnknownWeightError, a KeyError) before any write when a slice
        is not this rank's own."""
        parts, offset = [], 0
        for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"]):
            part, dt = self.own_part(name), parse_dtype(dtype)
            if list(part.shape) != list(shape) or part.dtype != dt:
                raise ValueError(f"weight {name!r}: tp_rank {self.rank} of {self.tp} holds {part.dtype}"
                                 f"{list(part.shape)}, the sender wrote {dt}{list(shape)}")
            parts.append((part, dt, shape, offset))
            offset += part.numel() * part.element_size()
        if offset != payload.numel():
            raise ValueError(f"bucket payload has {payload.numel()} bytes, its names account for {offset}")
        for part, dt, shape, start in parts:
            nbytes = part.numel() * part.element_size()
            part.copy_(payload[start:start + nbytes].view(dt).view(shape))


def share_with_ranks(state) -> None:
    """Once per server: move the weights to shared memory and hand them to TP ranks 1..N-1 (with one
    rank they stay where they are)."""
    if getattr(state, "shard_params", None) is not None:
        return
    if state.tp_ranks.tp == 1:
        state.shard_params = dict(state.weights.params)
        return
    params = {name: tensor.share_memory_() for name, tensor in state.weights.params.items()}
    state.tp_ranks.send("shard_attach", lambda i: params)
    state.tp_ranks.collect()
    state.shard_params = params


NOT_ENABLED = ("shard writes are off: start the server with --shard-writes (SGLang has no such route; its "
               "per-rank writes go through the Mooncake transfer engine, docs/weights.md)")


def add_routes(router, state) -> None:
    router.add_post("/sao_join_shard_groups", lambda q: join_groups(state, q))
    router.add_post("/sao_destroy_shard_groups", lambda q: destroy_groups(state, q))


def _entries(body: dict, tp: int) -> dict[int, dict]:
    """The join entries by TP rank: each rank at most once, fields typed."""
    from .protocol import BadRequest

    entries = body.get("groups")
    if not isinstance(entries, list) or not entries:
        raise BadRequest("field 'groups' must be a non-empty list of {tp_rank, master_port, group_name, "
                         "group_rank, world_size}")
    by_rank = {}
    for entry in entries:
        keys = ("tp_rank", "master_port", "group_name", "group_rank", "world_size")
        if not isinstance(entry, dict) or any(k not in entry for k in keys):
            raise BadRequest(f"every entry of 'groups' needs {', '.join(keys)}; got {entry!r}")
        rank = entry["tp_rank"]
        if not isinstance(rank, int) or not 0 <= rank < tp or rank in by_rank:
            raise BadRequest(f"groups: tp_rank {rank!r} must be a distinct rank of 0..{tp - 1} (--tp {tp})")
        by_rank[rank] = entry
    return by_rank


async def join_groups(state, request):
    from .http_io import read_json, required, result
    from .rank_calls import in_thread, on_every_rank

    body = await read_json(request)
    if not getattr(state, "shard_writes", False):
        return result(False, NOT_ENABLED)
    address, tp = required(body, "master_address", str), state.tp_ranks.tp
    by_rank = _entries(body, tp)

    def join():
        share_with_ranks(state)
        own = by_rank.get(0)
        mine, _ = on_every_rank(
            state, "shard_join", lambda i: (by_rank[i], address, tp, "gloo") if i in by_rank else None,
            lambda: own and join_and_serve(own, address, ShardTarget(state.shard_params, tp, 0), "gloo",
                                           state.weight_sync_timeout_s))
        return mine
    try:
        group = await in_thread(state, join)
    except RuntimeError as err:
        return result(False, f"Failed to join shard groups: {err}.")
    state.shard_groups = {**getattr(state, "shard_groups", {}), **{e["group_name"]: None for e in by_rank.values()}}
    if group is not None:
        state.shard_groups[by_rank[0]["group_name"]] = group
    return result(True, f"TP ranks {sorted(by_rank)} joined their shard groups.")


async def destroy_groups(state, request):
    from .http_io import read_json, required, result
    from .weight_group import destroy_weight_update_group
    from .rank_calls import in_thread, on_every_rank

    names = required(await read_json(request), "group_names", list)
    groups = getattr(state, "shard_groups", {})
    own = [groups.pop(n) for n in names if groups.get(n) is not None]

    def destroy():
        on_every_rank(state, "shard_destroy", lambda i: names, lambda: [destroy_weight_update_group(g) for g in own])
    await in_thread(state, destroy)
    return result(True, "Succeeded to destroy shard groups.")
