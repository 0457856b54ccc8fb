"""Context parallel (parallel.cp): which sequence positions each CP rank holds, and the way back.

Megatron's layout (``megatron/core/utils.py`` get_batch_on_this_cp_rank): the padded sequence is cut
into ``2*cp`` equal chunks and CP rank r keeps chunks ``r`` and ``2*cp-1-r``, in that order. Under
causal attention a late chunk costs more than an early one, so pairing the i-th with the i-th from
the end gives every rank the same work. Tokens, position ids, loss inputs and routes all follow it;
TE's attention exchanges keys/values inside the CP group and RoPE slices itself the same way.

The loss stays exactly the one of cp = 1: each rank computes per-position quantities (logprobs,
entropy, values) for its own positions, ``gather`` puts them back in sequence order on every rank,
and every CP rank then evaluates the same full-sequence loss (sequence-level losses such as GSPO
need whole rows). ``gather``'s backward hands each rank only the gradient of its own positions,
with no sum: the loss is replicated, not split, so a sum would count it cp times. Megatron's DDP
then sums parameter gradients over data x context parallel ranks, which adds the CP ranks' disjoint
token contributions into the full gradient. The token count the loss divides by is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


def chunk_order(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) this rank holds, in the order it holds them."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Indices into the padded sequence that CP rank `cp_rank` holds, in its local order."""
    if cp_size == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2*cp = {2 * cp_size}; pad micro-batches "
                         f"with packing.seq_multiple (parallel.cp = {cp_size})")
    chunk = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_order(cp_rank, cp_size)])


def split_for_rank(t: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """`t` restricted to this CP rank's positions along `dim` (the sequence dimension)."""
    if cp_size == 1:
        return t
    index = local_positions(t.shape[dim], cp_rank, cp_size).to(t.device)
    return t.index_select(dim, index).contiguous()


def restore_order(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Every rank's local tensor (rank order) -> the tensor in sequence order (the inverse of the split)."""
    cp_size = len(pieces)
    if cp_size == 1:
        return pieces[0]
    stacked = torch.cat(pieces, dim=dim)
    order = torch.cat([local_positions(stacked.shape[dim], r, cp_size) for r in range(cp_size)]).to(stacked.device)
    return torch.empty_like(stacked).index_copy_(dim, order, stacked)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence in Megatron's CP order; backward = this rank's slice, no sum."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, dim: int, rank: int, group) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.size = dim, rank, torch.distributed.get_world_size(group)
        pieces = [torch.empty_like(local) for _ in range(ctx.size)]
        torch.distributed.all_gather(pieces, local.contiguous(), group=group)
        return restore_order(pieces, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return split_for_rank(grad, ctx.rank, ctx.size, ctx.dim), None, None, None


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its context-parallel group; size 1 makes every method the identity."""

    rank: int = 0
    size: int = 1
    group: Optional[Any] = None

    @classmethod
    def from_megatron(cls) -> "ContextParallel":
        from megatron.core import parallel_state

        size = parallel_state.get_context_parallel_world_size()
        if size == 1:
            return cls()
        return cls(parallel_state.get_context_parallel_rank(), size, parallel_state.get_context_parallel_group())

    def split(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return split_for_rank(t, self.rank, self.size, dim)

    def gather(self, local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's positions -> the whole sequence on every CP rank (differentiable, see module doc)."""
        if self.size == 1:
            return local
        return _GatherSequence.apply(local, dim, self.rank, self.group)
