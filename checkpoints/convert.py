"""HF <-> Megatron-Core (local spec) conversion of whole state dicts, pure tensors, any TP/EP/PP/VPP.

`hf_to_mcore(hf, spec, layout)` gives one rank's state dicts (one per virtual pipeline chunk, with the
rank's local layer and expert numbering); `mcore_to_hf(shards, spec)` merges the shards of every rank
back into HF tensors. Both are exact (no arithmetic, only slicing and concatenation), so a round trip
is bit-identical. Names and layouts: checkpoints/name_map.py and checkpoints/tensor_layouts.py.

This is our own mapping rather than mbridge or megatron-bridge; docs/weights.md says why.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Iterator, Mapping, Sequence

import torch

from .arch.spec import ArchSpec
from .layout import ShardLayout
from .name_map import OUTPUT, Rule, all_rules, canonical_mcore_name, embedding_rule, final_rules, layer_rules
from .tensor_layouts import merge_tp, pack_glu, pack_qkv, split_tp, unpack_glu, unpack_qkv


def pack_rule(rule: Rule, hf: Mapping[str, torch.Tensor], spec: ArchSpec) -> torch.Tensor:
    """The full (unsharded) Megatron tensor of `rule` from HF tensors."""
    missing = [n for n in rule.hf if n not in hf]
    if missing:
        raise KeyError(f"HF checkpoint lacks {missing[0]} (needed for {rule.mcore}); "
                       f"fix: check the architecture ({spec.arch}) and that the checkpoint is complete")
    parts = [hf[n] for n in rule.hf]
    if rule.pack == "qkv":
        return pack_qkv(*parts, num_kv_heads=spec.num_kv_heads)
    if rule.pack == "glu":
        return pack_glu(*parts)
    return parts[0]


def unpack_rule(rule: Rule, full: torch.Tensor, spec: ArchSpec) -> dict[str, torch.Tensor]:
    """HF tensors of `rule` from its full Megatron tensor."""
    if rule.pack == "qkv":
        parts = unpack_qkv(full, spec.num_kv_heads, spec.heads_per_group, spec.head_dim)
    elif rule.pack == "glu":
        parts = unpack_glu(full)
    else:
        parts = (full,)
    return dict(zip(rule.hf, parts))


def chunk_rules(spec: ArchSpec, layout: ShardLayout, vp_stage: int, with_output: bool = True) -> list[Rule]:
    """The rules whose tensors live on this rank's virtual chunk `vp_stage` (its experts only).
    with_output=False leaves out output_layer (a critic keeps its own value head)."""
    experts = layout.expert_range(spec.num_experts)
    rules = [embedding_rule()] if layout.has_embedding(vp_stage) else []
    for L in layout.layer_range(spec.num_layers, vp_stage):
        rules += [r for r in layer_rules(spec, L) if r.expert is None or r.expert in experts]
    if layout.has_output(vp_stage):
        rules += final_rules(spec, include_tied_output=not layout.has_embedding(vp_stage))
    return [r for r in rules if with_output or r.mcore != OUTPUT]


def local_name(rule: Rule, spec: ArchSpec, layout: ShardLayout, vp_stage: int) -> str:
    """Rename a global Megatron name to this chunk's local layer / expert numbering."""
    name = rule.mcore
    if rule.layer is not None:
        local = rule.layer - layout.layer_range(spec.num_layers, vp_stage).start
        name = name.replace(f"decoder.layers.{rule.layer}.", f"decoder.layers.{local}.", 1)
    if rule.expert is not None:
        local = rule.expert - layout.expert_range(spec.num_experts).start
        name = name.replace(f"local_experts.{rule.expert}.", f"local_experts.{local}.", 1)
    return name


def _tp(rule: Rule, layout: ShardLayout) -> tuple[int, int]:
    """(rank, size) that splits this rule's tensor: expert TP for routed experts, TP otherwise."""
    if rule.expert is not None:
        return layout.expert_tp_rank, layout.expert_tp_size
    return layout.tp_rank, layout.tp_size


def shard_rule(rule: Rule, full: torch.Tensor, spec: ArchSpec, layout: ShardLayout) -> torch.Tensor:
    rank, size = _tp(rule, layout)
    return split_tp(full, rule.split, rank, size, layout.padded_vocab(spec.vocab_size))


def hf_to_mcore(hf: Mapping[str, torch.Tensor], spec: ArchSpec, layout: ShardLayout,
                with_output: bool = True) -> list[dict[str, torch.Tensor]]:
    """One rank's Megatron state dicts (one per virtual chunk) from a full HF state dict.

    `hf` may be lazy (checkpoints/hf_io.HFCheckpoint): only the tensors this rank needs are read.
    with_output=False is the critic's load: the backbone only, no output_layer (lm_head).
    """
    chunks = []
    for v in range(layout.vpp_size):
        chunks.append({local_name(r, spec, layout, v): shard_rule(r, pack_rule(r, hf, spec), spec, layout)
                       for r in chunk_rules(spec, layout, v, with_output)})
    return chunks


def holder(rule: Rule, spec: ArchSpec, layout: ShardLayout) -> tuple[int, int, int]:
    """(pp_rank, vp_stage, ep_rank) of the chunk that holds `rule` (ep_rank 0 for replicated params)."""
    ep = rule.expert // (spec.num_experts // layout.ep_size) if rule.expert is not None else 0
    if rule.layer is None:
        first = rule.mcore.startswith("embedding.")
        return (0, 0, 0) if first else (layout.pp_size - 1, layout.vpp_size - 1, 0)
    for pp_rank, vp_stage in itertools.product(range(layout.pp_size), range(layout.vpp_size)):
        if rule.layer in replace(layout, pp_rank=pp_rank).layer_range(spec.num_layers, vp_stage):
            return pp_rank, vp_stage, ep
    raise ValueError(f"layer {rule.layer} is outside the model's {spec.num_layers} layers")


def iter_mcore_to_hf(shards: Mapping[ShardLayout, Sequence[Mapping[str, torch.Tensor]]],
                     spec: ArchSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Merge every rank's shards (keyed by its ShardLayout) into (hf_name, tensor), HF stream order.
    Shards may use Transformer Engine names (fused norms, grouped experts): see canonical_mcore_name."""
    index = {(l.pp_rank, l.tp_rank, l.ep_rank): (l, [{canonical_mcore_name(k): t for k, t in c.items()} for c in sd])
             for l, sd in shards.items()}
    ref = next(iter(shards))
    for rule in all_rules(spec):
        pp, v, ep = holder(rule, spec, ref)
        _, size = _tp(rule, ref)
        pieces = []
        for t in range(size):
            key = (pp, t, ep)
            if key not in index:
                raise KeyError(f"no shard for pp_rank={pp} tp_rank={t} ep_rank={ep}; fix: pass every rank's shard")
            layout, chunks = index[key]
            name = local_name(rule, spec, layout, v)
            if name not in chunks[v]:
                raise KeyError(f"shard pp={pp} tp={t} ep={ep} chunk {v} lacks {name} (HF {rule.hf[0]})")
            pieces.append(chunks[v][name])
        full = merge_tp(pieces, rule.split, spec.vocab_size)
        yield from unpack_rule(rule, full, spec).items()


def mcore_to_hf(shards: Mapping[ShardLayout, Sequence[Mapping[str, torch.Tensor]]],
                spec: ArchSpec) -> dict[str, torch.Tensor]:
    return dict(iter_mcore_to_hf(shards, spec))


def shard_all(hf: Mapping[str, torch.Tensor], spec: ArchSpec, layouts) -> dict[ShardLayout, list[dict]]:
    """Every rank's shards of a layout (tests, offline conversion)."""
    return {layout: hf_to_mcore(hf, spec, layout) for layout in layouts}


__all__ = ["hf_to_mcore", "mcore_to_hf", "iter_mcore_to_hf", "shard_all", "pack_rule", "unpack_rule",
           "chunk_rules", "local_name", "holder"]
