"""Move full HF tensors into this rank's Megatron shards, and gather them back under HF names.

Which slice a parameter holds comes from Megatron's own attributes: ``tensor_model_parallel`` and
``partition_dim`` (TP split), ``allreduce=False`` (expert parameter: split over the expert-TP group),
each layer's ``layer_number`` and each MoE layer's ``local_expert_indices`` (PP/VPP/EP placement).

Export: TP pieces are all-gathered inside each (expert-)TP group; the owner of a full tensor is the
rank with (expert-)TP rank 0 and (expert-)DP rank 0 on the stage that holds it; owners announce
their names (all_gather_object) and then broadcast one tensor at a time, so every rank yields the
same sequence and holds at most one gathered tensor beyond its own full shards.
"""
from __future__ import annotations

import re
from typing import Iterator, Mapping

import torch

from .distributed import comm_device
from .hf_mapping import HFMapping, MappingError

VALUE_HEAD = "value_head.weight"


def _is_expert(param) -> bool:
    return not getattr(param, "allreduce", True)


def _tp(param):
    from megatron.core import parallel_state as ps

    if _is_expert(param):
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()


def _split_dim(param):
    return getattr(param, "partition_dim", 0) if getattr(param, "tensor_model_parallel", False) else None


def _tensors(module: torch.nn.Module):
    yield from module.named_parameters()
    for name, buf in module.named_buffers():
        if name.endswith("router.expert_bias"):
            yield name, buf


@torch.no_grad()
def load_hf_tensors(module: torch.nn.Module, base: HFMapping, hf: Mapping[str, torch.Tensor],
                    skip: tuple = ()) -> None:
    """Copy this rank's slice of every Megatron tensor of `module` from the full HF state dict."""
    mapping = base.for_module(module)
    for name, param in _tensors(module):
        if name.startswith(skip):
            continue
        rank, size, _ = _tp(param)
        rule = mapping.rule(name)
        shard = mapping.shard(rule, mapping.full_tensor(rule, hf), param, rank, size)
        if shard.shape != param.shape:
            raise MappingError(f"{name}: HF tensors give shape {tuple(shard.shape)} for this rank, "
                               f"the model has {tuple(param.shape)}; config.json and weights disagree")
        param.copy_(shard.to(param.dtype))


def _gather_tp(param: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    if size == 1 or _split_dim(param) is None:
        return [param.detach()]
    pieces = [torch.empty_like(param) for _ in range(size)]
    torch.distributed.all_gather(pieces, param.detach().contiguous(), group=group)
    return pieces


def _owns(param, tp_rank: int) -> bool:
    from megatron.core import parallel_state as ps

    dp_rank = ps.get_expert_data_parallel_rank() if _is_expert(param) else ps.get_data_parallel_rank()
    return tp_rank == 0 and dp_rank == 0


def _owned_full_tensors(modules, base: HFMapping, value_head: bool) -> dict[str, torch.Tensor]:
    owned: dict[str, torch.Tensor] = {}
    for module in modules:
        mapping = base.for_module(module)
        for name, param in _tensors(module):
            rank, size, group = _tp(param)
            pieces = _gather_tp(param, size, group)
            if not _owns(param, rank):
                continue
            if name.startswith("output_layer.") and value_head:
                owned[VALUE_HEAD] = pieces[0].clone()
                continue
            rule = mapping.rule(name)
            full = mapping.unshard(rule, pieces, param)
            for hf_name, tensor in mapping.to_hf(rule, full):
                owned[hf_name] = tensor.contiguous().clone()
    return owned


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def export_hf_tensors(modules, base: HFMapping, value_head: bool = False,
                      scope: str = "all") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) in natural name order.

    scope="all": every tensor of the model, on every rank (stages broadcast theirs to all).
    scope="stage": only the tensors this rank's pipeline stage holds, on every rank of that stage
    (one weight sender per stage; nothing crosses stages).
    """
    if scope not in ("all", "stage"):
        raise ValueError(f"export scope {scope!r}; use 'all' or 'stage'")
    owned = _owned_full_tensors(modules, base, value_head)
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        for name in sorted(owned, key=_natural_key):
            yield name, owned[name]
        return
    group = None
    if scope == "stage":
        from .distributed import pipeline_stage_group

        _, group, _ = pipeline_stage_group()
    rank = torch.distributed.get_rank()
    members = torch.distributed.get_process_group_ranks(group) if group is not None else \
        list(range(torch.distributed.get_world_size()))
    catalog = [None] * len(members)
    torch.distributed.all_gather_object(catalog, {n: (tuple(t.shape), t.dtype) for n, t in owned.items()}, group=group)
    owner = {}
    for src, names in zip(members, catalog):
        for name, meta in names.items():
            owner.setdefault(name, (src, meta))
    for name in sorted(owner, key=_natural_key):
        src, (shape, dtype) = owner[name]
        tensor = owned[name] if src == rank else torch.empty(shape, dtype=dtype, device=comm_device())
        torch.distributed.broadcast(tensor, src=src, group=group)
        yield name, tensor
