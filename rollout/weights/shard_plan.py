"""Which slice of an HF tensor one engine TP rank holds: the plan shard-aware senders follow.

An SGLang engine with TP N keeps on rank r only the part of each weight its layer type loads
(layers/linear.py and vocab_parallel_embedding.py of SGLang): column-parallel projections keep rows
r*n/N..(r+1)*n/N, row-parallel ones columns, the vocabulary embedding and LM head vocabulary rows,
and everything else (norms, the router, biases of row-parallel layers) whole on every rank. A sender
that knows this sends rank r those bytes only, instead of every byte to every rank.

The rules below are the reference server's TP layout (`sao serve --tp N --shard-writes`), on HF
names. SGLang's own layout adds packing (qkv_proj, gate_up_proj, w13_weight), vocabulary padding and
expert parallelism; docs/weights.md ("Shard writes") says what a sender for it must add. A dimension
that does not divide by N stays whole on every rank (more bytes, never wrong bytes).
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Optional

import torch

COLUMN = "column"
ROW = "row"
VOCAB = "vocab"
REPLICATED = "replicated"

# q/k/v, GLU gate/up (dense, shared and routed experts), MLA's q_b_proj / kv_b_proj: output rows split
_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|q_b_proj|kv_b_proj)\.(weight|bias)$")
# o_proj and down_proj (dense, shared and routed experts): input columns split
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


def split_kind(name: str) -> str:
    """How TP splits the HF tensor `name`: column, row, vocab or replicated."""
    if _COLUMN.search(name):
        return COLUMN
    if _ROW.search(name):
        return ROW
    if _VOCAB.search(name):
        return VOCAB
    return REPLICATED


def rank_slice(name: str, shape: tuple[int, ...], tp: int, rank: int) -> Optional[tuple[int, int, int]]:
    """(dim, start, length) of TP rank `rank`'s part of `name`, or None when the rank holds it whole."""
    if not 0 <= rank < tp:
        raise ValueError(f"tp_rank {rank} outside 0..{tp - 1}")
    kind = split_kind(name)
    if tp == 1 or kind == REPLICATED or not shape:
        return None
    dim = len(shape) - 1 if kind == ROW else 0
    if shape[dim] % tp:
        return None
    length = shape[dim] // tp
    return dim, rank * length, length


def shard_of(name: str, tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The view of `tensor` that TP rank `rank` holds (not copied; a row split is not contiguous)."""
    cut = rank_slice(name, tuple(tensor.shape), tp, rank)
    return tensor if cut is None else tensor.narrow(*cut)


def shard_nbytes(name: str, shape: tuple[int, ...], element_size: int, tp: int, rank: int) -> int:
    cut = rank_slice(name, shape, tp, rank)
    numel = math.prod(shape) if cut is None else math.prod(shape) // shape[cut[0]] * cut[2]
    return numel * element_size


def bytes_per_rank(named: Iterable[tuple[str, torch.Tensor]], tp: int) -> list[int]:
    """What each TP rank of one engine receives under shard writes (a broadcast sends each the total)."""
    totals = [0] * tp
    for name, tensor in named:
        for rank in range(tp):
            totals[rank] += shard_nbytes(name, tuple(tensor.shape), tensor.element_size(), tp, rank)
    return totals
