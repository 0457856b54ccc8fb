"""Move full HF tensors into this rank's Megatron shards, and gather them back under HF names.

Which slice a parameter holds comes from Megatron's own attributes: ``tensor_model_parallel`` and
``partition_dim`` (TP split), ``allreduce=False`` (expert parameter: split over the expert-TP group),
each layer's ``layer_number`` and each MoE layer's ``local_expert_indices`` (PP/VPP/EP placement).

Export, streamed: the owner of a full tensor is the rank with (expert-)TP rank 0 and (expert-)DP rank
0 on the stage that holds it; owners announce the HF names they will make (all_gather_object of a
catalog built on the meta device, nothing gathered yet), then the ranks walk the names in one order:
at the turn of a Megatron tensor's first HF name every rank holding it all-gathers its TP pieces
inside its (expert-)TP group, and each name is broadcast from its owner. Every rank yields the same
sequence; a rank holds the tensor being gathered and the HF tensors of the previous one still waiting
for their turn (q, v after k), never every tensor it owns.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
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


@dataclass
class _Source:
    """One local Megatron tensor, the HF tensors it makes (names, shapes, dtypes) and whether this rank
    owns them; the catalog is built on the meta device, so nothing is gathered before its turn."""
    name: str
    param: torch.Tensor
    mapping: HFMapping
    tp: tuple
    owns: bool
    hf: dict          # HF name -> (shape, dtype), in to_hf order
    value_head: bool = False


def _convert(source: _Source, pieces: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of one source from its TP pieces (meta pieces: only the shapes)."""
    if source.value_head:
        yield VALUE_HEAD, pieces[0]
        return
    rule = source.mapping.rule(source.name)
    full = source.mapping.unshard(rule, pieces, source.param)
    pieces.clear()   # the caller's list too: the pieces go as soon as the full tensor exists
    for hf_name, tensor in source.mapping.to_hf(rule, full):
        yield hf_name, tensor.contiguous()


def _sources(modules, base: HFMapping, value_head: bool) -> list[_Source]:
    sources = []
    for module in modules:
        mapping = base.for_module(module)
        for name, param in _tensors(module):
            rank, size, group = _tp(param)
            source = _Source(name, param, mapping, (rank, size, group), _owns(param, rank), {},
                             value_head and name.startswith("output_layer."))
            meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
            pieces = [meta] * (size if _split_dim(param) is not None else 1)
            source.hf = {n: (tuple(t.shape), t.dtype) for n, t in _convert(source, pieces)}
            sources.append(source)
    return sources


def _own_storage(tensor: torch.Tensor, param: torch.Tensor, snapshot: bool = True) -> torch.Tensor:
    """`tensor`, copied when it is a view: of the live parameter (when the export is a snapshot) or of a
    larger merged tensor (gate of gate+up, the vocabulary before trimming, after a TP gather), which a
    consumer keeping it would otherwise hold whole. Without a snapshot a view of the parameter itself
    passes as it is: it costs no memory (the parameter lives anyway). Every other exported tensor owns
    exactly its bytes, as before streaming."""
    storage = tensor.untyped_storage()
    of_param = storage.data_ptr() == param.untyped_storage().data_ptr()
    if of_param and not snapshot:
        return tensor
    if of_param or storage.nbytes() != tensor.nbytes:
        return tensor.clone()
    return tensor


def _gather_and_convert(source: _Source, keep: set, holders: bool = False,
                        snapshot: bool = True) -> dict[str, torch.Tensor]:
    """Every rank holding `source` takes part in its TP gather; the owner (with `holders`, every rank
    of the gather: each has all the pieces) keeps the HF tensors in `keep`, each in its own memory
    (`snapshot`), or without a snapshot as a view of the parameter where no conversion was needed."""
    _, size, group = source.tp
    pieces = _gather_tp(source.param, size, group)
    if not (source.owns or holders):
        return {}
    return {n: _own_storage(t, source.param, snapshot) for n, t in _convert(source, pieces) if n in keep}


def natural_key(name: str) -> list:
    """The export's order of HF names: numbers compared as numbers (layers.10 after layers.9)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _holders(sources: list[_Source]) -> dict[str, tuple[int, int]]:
    """HF name -> (this rank's index among the ranks that make it, how many do), for the names this
    rank makes; every rank computes the same lists (an all_gather_object of each rank's names)."""
    mine = sorted({n for s in sources for n in s.hf})
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return {n: (0, 1) for n in mine}
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    ranks: dict[str, list[int]] = {}
    for src, names in enumerate(everyone):
        for name in names:
            ranks.setdefault(name, []).append(src)
    rank = torch.distributed.get_rank()
    return {n: (ranks[n].index(rank), len(ranks[n])) for n in mine}


def _catalog(sources: list[_Source], scope: str):
    """(owner: HF name -> (source rank, shape, dtype), this rank, group) over the export's ranks;
    the owner of a name is the first rank that owns it, as every rank computes alike."""
    mine = {n: meta for s in sources if s.owns for n, meta in s.hf.items()}
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return {n: (0, *meta) for n, meta in mine.items()}, 0, None
    group = None
    if scope == "stage":
        from .distributed import pipeline_stage_group

        _, group, _ = pipeline_stage_group()
    members = torch.distributed.get_process_group_ranks(group) if group is not None else \
        list(range(torch.distributed.get_world_size()))
    catalog = [None] * len(members)
    torch.distributed.all_gather_object(catalog, mine, group=group)
    owner = {}
    for src, names in zip(members, catalog):
        for name, meta in names.items():
            owner.setdefault(name, (src, *meta))
    return owner, torch.distributed.get_rank(), group


def export_hf_tensors(modules, base: HFMapping, value_head: bool = False,
                      scope: str = "all", snapshot: bool = True) -> Iterator[tuple]:
    """Yield (HF name, full tensor) in natural name order, streamed.

    scope="all": every tensor of the model, on every rank (stages broadcast theirs to all).
    scope="stage": only the tensors this rank's pipeline stage holds, on every rank of that stage
    (one weight sender per stage; nothing crosses stages).
    scope="shares": on each rank the tensors it holds once its (expert-)TP group has gathered them,
    never broadcast, as (name, tensor, (i, n)): this rank is holder i of the n ranks that hold the
    name (every TP, CP and DP replica of its stage; for an expert, of its EP slice). Shard writes
    deal the engine ranks among the holders (target t goes to holder t mod n), so a tensor every
    engine rank needs whole (attention under dp-attention) leaves from all its holders at once, and
    no rank ever holds more than its own stage. Every rank walks the whole order, so each TP group's
    gathers run in the same order on its ranks.

    A Megatron tensor is gathered at the turn of the first HF name it makes (every rank holding it
    joins its TP gather then, so each group's collectives run in the same order on its ranks), and
    its other HF tensors wait for their own turns: the export holds one tensor being gathered and
    what is left of the one before it (weight_sync.max_sender_mb bounds the sender: docs/weights.md).

    snapshot (the default): each tensor owns exactly its bytes, a copy of the parameter at export time.
    snapshot=False: a tensor that needs no conversion is a view of the live parameter (with Megatron's
    distributed optimizer, of its contiguous parameter buffer: the broadcast sender sends runs of it
    without a copy, rollout/weights/bucketing.py); valid only until the parameters change. A view of
    anything else (a TP-gathered tensor's part) is still copied, so every view the export yields is of
    memory that lives anyway: a consumer holding views holds nothing more.
    """
    if scope not in ("all", "stage", "shares"):
        raise ValueError(f"export scope {scope!r}; use 'all', 'stage' or 'shares'")
    sources = _sources(modules, base, value_head)
    owner, rank, group = _catalog(sources, scope)
    order = sorted(owner, key=natural_key)
    turn = {name: i for i, name in enumerate(order)}
    due: dict[int, _Source] = {}
    for source in sources:
        turns = [turn[n] for n in source.hf if n in turn]
        if turns:
            due[min(turns)] = source
    keep = {n for n, (src, _, _) in owner.items() if src == rank}
    if scope == "shares":
        holders = _holders(sources)
        keep = set(holders)
    ready: dict[str, torch.Tensor] = {}
    distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    for i, name in enumerate(order):
        if i in due:
            ready.update(_gather_and_convert(due.pop(i), keep, holders=scope == "shares", snapshot=snapshot))
        src, shape, dtype = owner[name]
        if scope == "shares":
            if name in ready:
                yield name, ready.pop(name), holders[name]
            continue
        tensor = ready.pop(name) if src == rank else torch.empty(shape, dtype=dtype, device=comm_device())
        if distributed:
            torch.distributed.broadcast(tensor, src=src, group=group)
        yield name, tensor
        del tensor
