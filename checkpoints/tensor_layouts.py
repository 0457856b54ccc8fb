"""How HF tensors pack into Megatron tensors, and how Megatron tensors split across TP ranks.

Packing (full, unsharded tensors; source: Megatron-Core attention.py get_query_key_value_tensors and
MLP gated_linear_unit, cross-checked by logits in tests/distributed/test_convert_megatron.py):
- QKV: linear_qkv = concat over KV groups k of [the group's heads_per_group query heads; k head k;
  v head k], rows of head_dim each. Biases pack the same way.
- GLU fc1: linear_fc1 = cat[gate; up] on dim 0.

Splitting (one TP rank's piece of a full tensor):
- "col": dim 0 in equal chunks. QKV is "col" because a chunk of the grouped layout is a set of
  whole KV groups (Megatron requires num_query_groups % tp == 0).
- "row": dim 1 in equal chunks (linear_proj, linear_fc2).
- "glu": gate and up are chunked separately and re-joined per rank: rank r = cat[gate_r; up_r].
- "vocab": dim 0 after zero-padding the rows to the padded vocabulary.
- "rep": replicated (norms, router).
"""
from __future__ import annotations

import torch


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[nh*d, ...], [ng*d, ...], [ng*d, ...] -> [ng*(nh/ng + 2)*d, ...] grouped per KV group."""
    rest = q.shape[1:]
    qg = q.reshape(num_kv_heads, -1, *rest)
    kg = k.reshape(num_kv_heads, -1, *rest)
    vg = v.reshape(num_kv_heads, -1, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def unpack_qkv(qkv: torch.Tensor, num_kv_heads: int, heads_per_group: int, head_dim: int):
    """Inverse of pack_qkv: -> (q, k, v)."""
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, (heads_per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def pack_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def unpack_glu(fc1: torch.Tensor):
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def split_tp(full: torch.Tensor, kind: str, rank: int, size: int, padded_rows: int = 0) -> torch.Tensor:
    """This TP rank's piece of `full` (see the module docstring for the kinds)."""
    if kind == "rep" or size == 1 and kind != "vocab":
        return full
    if kind == "col":
        return _chunk(full, 0, rank, size)
    if kind == "row":
        return _chunk(full, 1, rank, size)
    if kind == "glu":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([_chunk(gate, 0, rank, size), _chunk(up, 0, rank, size)], dim=0)
    if kind == "vocab":
        pad = padded_rows - full.shape[0]
        if pad > 0:
            full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])], dim=0)
        return _chunk(full, 0, rank, size)
    raise ValueError(f"unknown split kind {kind!r}")


def merge_tp(pieces: list[torch.Tensor], kind: str, rows: int = 0) -> torch.Tensor:
    """Inverse of split_tp over all TP ranks in rank order; "vocab" trims to `rows`."""
    if kind == "rep" or len(pieces) == 1 and kind not in ("vocab",):
        return pieces[0]
    if kind == "col":
        return torch.cat(pieces, dim=0)
    if kind == "row":
        return torch.cat(pieces, dim=1)
    if kind == "glu":
        halves = [torch.chunk(p, 2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if kind == "vocab":
        return torch.cat(pieces, dim=0)[:rows]
    raise ValueError(f"unknown split kind {kind!r}")


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"dim {dim} of a {tuple(t.shape)} tensor does not split into {size} TP chunks")
    return torch.chunk(t, size, dim=dim)[rank].contiguous()
