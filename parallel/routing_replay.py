"""Routing replay: force the trainer's routers to the experts the engine used, and measure agreement.

Engine routes come per sample as int32 ``[tokens - 1, num_hidden_layers, topk]`` (records.py); in a
TrainBatch they are ``routed_experts [rows, seq, num_hidden_layers, topk]`` with -1 where a position
has no route (the last token and padding). The layer axis is SGLang's: every hidden layer, column =
global 0-based layer id, dense layers' columns left zero (state_capturer/routed_experts.py sizes it
by num_hidden_layers; each TopK writes its own layer_id). Dense columns are never read. Megatron's
router (``moe_enable_routing_replay``) takes, per local MoE layer, int64 ``[local_tokens, topk]`` in
its own token order, which is:

- ``[seq, rows]`` flattened (sequence-major: token index = s * rows + b);
- under sequence parallel, TP rank r holds positions ``[r*seq/tp, (r+1)*seq/tp)``;
- each pipeline (and virtual) stage holds only its own layers; a router knows its global
  ``layer_number`` (1-based), whose 0-based id is its column of the routes.

Positions without a route get the placeholder experts 0..k-1: they are the final token and padding,
which come after every real position, so under causal attention they cannot change any logprob.

``train/route_agreement`` = fraction of (token, MoE layer) pairs, over positions with a recorded
route, where the recorded top-k set equals the set the trainer's router would pick itself from the
same scores (summed over all ranks: SP, PP and DP ranks see disjoint pairs).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch


def _replay_api():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    return RouterReplay, RouterReplayAction


def routers_of(model_chunk: torch.nn.Module) -> list:
    """(global 0-based layer, router) for every MoE router in this model chunk, in layer order."""
    found = []
    for module in model_chunk.modules():
        replay = getattr(module, "router_replay", None)
        if replay is not None and getattr(module, "layer_number", None) is not None:
            found.append((module.layer_number - 1, module))
    return sorted(found, key=lambda x: x[0])


def local_token_routes(routes: torch.Tensor, tp_rank: int, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """[rows, seq, L, k] -> this rank's [local_tokens, L, k] in Megatron's [s, b] order.

    Under context parallelism `routes` already holds only this CP rank's positions, in the order the
    rank holds them (schedule.context_local, Megatron's chunks r and 2*cp-1-r): the embedding output
    is that CP-local sequence, and sequence parallel then splits it over TP ranks as below."""
    seq = routes.shape[1]
    routes = routes.transpose(0, 1)  # [seq, rows, L, k]
    if sequence_parallel and tp_size > 1:
        if seq % tp_size:
            raise ValueError(f"sequence length {seq} is not a multiple of tp={tp_size}; pad micro-batches "
                             f"to a multiple of tp (packing.seq_multiple, packing.pad_seq)")
        chunk = seq // tp_size
        routes = routes[tp_rank * chunk:(tp_rank + 1) * chunk]
    return routes.reshape(-1, *routes.shape[2:])


class RouteAgreement:
    """Counts (token, layer) pairs whose recorded routes equal the router's own choice."""

    def __init__(self):
        self.agree = 0
        self.total = 0
        self._valid: dict[int, torch.Tensor] = {}

    def reset(self) -> None:
        self.agree, self.total = 0, 0

    def watch(self, router) -> None:
        """Wrap the router's replay top-k so every replayed forward is also scored."""
        replay = router.router_replay
        if getattr(replay, "_sao_watched", False):
            return
        original = replay.get_replay_topk
        _, action_enum = _replay_api()

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            result = original(scores, topk, num_groups, group_topk, default_compute_topk)
            if replay.router_replay_action == action_enum.REPLAY_FORWARD:
                with torch.no_grad():
                    _, own = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
                self._count(id(replay), result[1], own)
            return result

        replay.get_replay_topk = get_replay_topk
        replay._sao_watched = True

    def set_valid(self, replay, valid: torch.Tensor) -> None:
        self._valid[id(replay)] = valid

    def _count(self, key: int, target: torch.Tensor, own: torch.Tensor) -> None:
        same = (target.sort(dim=-1).values == own.sort(dim=-1).values).all(dim=-1)
        valid = self._valid.get(key, torch.ones_like(same))
        self.agree += int((same & valid).sum())
        self.total += int(valid.sum())

    def reduced(self, group=None) -> Optional[float]:
        """Agreement over all ranks of `group` (None = world); None when nothing was replayed."""
        from .distributed import comm_device

        counts = torch.tensor([self.agree, self.total], dtype=torch.float64, device=comm_device())
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts, group=group)
        return float(counts[0] / counts[1]) if counts[1] > 0 else None


class RouteReplayer:
    """Sets replay targets on one model's routers per micro-batch and model chunk.

    Activation recompute (model.recompute = full) re-runs every layer's forward, router included,
    during backward, and Megatron never switches the routers to REPLAY_BACKWARD itself. So: each
    replayed forward appends its targets to every router's backward list (set_target_indices does);
    when a micro-batch's backward reaches a chunk's output, a hook there switches that chunk's
    routers to REPLAY_BACKWARD, and the recompute pops the oldest targets. A chunk runs its
    backwards in the order of its forwards (no pipelining, 1F1B, interleaved 1F1B), so the oldest
    targets are that micro-batch's own, not those of the last micro-batch forwarded.
    """

    def __init__(self, model_chunks: Iterable[torch.nn.Module], num_layers: int, top_k: int,
                 sequence_parallel: bool):
        self.chunks = list(model_chunks)
        self.num_layers = num_layers  # hidden layers: the width of the routes' layer axis
        self.top_k = top_k
        self.sequence_parallel = sequence_parallel
        self.agreement = RouteAgreement()
        self._routers = [routers_of(c) for c in self.chunks]
        self._replaying = [False] * len(self.chunks)  # did the chunk's latest forward replay routes
        for index, (chunk, routers) in enumerate(zip(self.chunks, self._routers)):
            for _, router in routers:
                self.agreement.watch(router)
            if routers:
                chunk.register_forward_hook(self._arm_backward(index))

    def _arm_backward(self, chunk_index: int):
        """Forward hook: the backward of this output first sets the routers up for its recompute."""
        def hook(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                replaying = self._replaying[chunk_index]
                output.register_hook(lambda grad: self._enter_backward(chunk_index, replaying))
        return hook

    def _enter_backward(self, chunk_index: int, replaying: bool) -> None:
        _, action = _replay_api()
        for _, router in self._routers[chunk_index]:
            if replaying:
                router.router_replay.set_router_replay_action(action.REPLAY_BACKWARD)
            else:  # a micro-batch without routes: the recompute chooses as its forward did
                router.router_replay.clear_router_replay_action()

    def set_routes(self, chunk_index: int, routes: Optional[torch.Tensor]) -> None:
        """Replay `routes` [rows, seq, num_layers, k] in this chunk's routers (router of global
        layer l <- column l); None = let the routers choose."""
        _, action = _replay_api()
        routers = self._routers[chunk_index]
        self._replaying[chunk_index] = routes is not None
        if routes is None:
            for _, router in routers:
                router.router_replay.clear_router_replay_action()
            return
        if routes.dim() != 4 or routes.shape[2] != self.num_layers:
            raise ValueError(f"routed_experts has shape {tuple(routes.shape)}; expected [rows, seq, {self.num_layers}, "
                             f"top_k]: one column per hidden layer (SGLang's layout, dense layers zero); fix: take "
                             f"routes from an engine serving this model")
        from megatron.core import parallel_state

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        local = local_token_routes(routes, tp_rank, tp_size, self.sequence_parallel)
        if local.shape[-1] != self.top_k:
            raise ValueError(f"routed_experts has top-k {local.shape[-1]}, the model routes to {self.top_k}")
        for layer, router in routers:
            target, valid = _fill_missing(local[:, layer].long(), self.top_k)
            router.router_replay.set_target_indices(target)
            router.router_replay.set_router_replay_action(action.REPLAY_FORWARD)
            self.agreement.set_valid(router.router_replay, valid)

    def clear(self) -> None:
        """Drop targets and actions (also the backward list, which grows with every set)."""
        for routers in self._routers:
            for _, router in routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()


def _fill_missing(target: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    valid = (target >= 0).all(dim=-1)
    placeholder = torch.arange(top_k, dtype=target.dtype, device=target.device).expand_as(target)
    return torch.where(valid.unsqueeze(-1), target, placeholder).contiguous(), valid


def record_routes(model_chunks, run_forward) -> list[torch.Tensor]:
    """Run `run_forward()` with the routers in RECORD mode; return [local_tokens, k] per router (layer order)."""
    _, action = _replay_api()
    routers = [r for chunk in model_chunks for r in routers_of(chunk)]
    for _, router in routers:
        router.router_replay.set_router_replay_action(action.RECORD)
    try:
        run_forward()
        return [router.router_replay.get_recorded_indices() for _, router in routers]
    finally:
        for _, router in routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
