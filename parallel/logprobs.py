"""Per-token logprobs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits z[..., v] for its vocabulary slice. With m = max_v z (all-reduce MAX,
no gradient: a constant shift), s = z - m, Z = sum_v exp(s) (all-reduce SUM):
    log p(t) = s_t - log Z                          (s_t all-reduced from the rank owning t)
    H = log Z - sum_v p_v s_v = log Z - (sum_v exp(s_v) s_v) / Z
The sums go through Megatron's reduce_from_tensor_model_parallel_region (forward all-reduce,
backward identity): the loss downstream is replicated on every TP rank, so each rank's slice gets
exactly dL/dsum. Columns at or past the real vocabulary (TP padding) are excluded.
"""
from __future__ import annotations

import torch


def _tp_info():
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group())


def vocab_parallel_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                    with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V/tp] (this rank's slice), targets [...] global ids -> (logp [...], entropy [...]).

    Differentiable w.r.t. `logits`; float32 throughout. `vocab_size` is the real (unpadded) size.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    rank, size, group = _tp_info()
    logits = logits.float()
    part = logits.shape[-1]
    start = rank * part
    valid = (torch.arange(start, start + part, device=logits.device) < vocab_size)
    with torch.no_grad():
        mx = logits.masked_fill(~valid, float("-inf")).max(dim=-1).values
        if size > 1:
            torch.distributed.all_reduce(mx, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = (logits - mx.unsqueeze(-1)).masked_fill(~valid, float("-inf"))
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    local_t = targets - start
    in_range = (local_t >= 0) & (local_t < part)
    picked = shifted.gather(-1, local_t.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
    target_shifted = reduce_from_tensor_model_parallel_region(torch.where(in_range, picked, torch.zeros_like(picked)))
    log_z = sum_exp.log()
    logp = target_shifted - log_z
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    weighted = reduce_from_tensor_model_parallel_region(
        torch.where(valid, exp * shifted.masked_fill(~valid, 0.0), torch.zeros_like(exp)).sum(dim=-1))
    entropy = log_z - weighted / sum_exp
    return logp, entropy


def token_logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
                               with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, seq, V/tp] at each position -> logp/entropy [rows, seq] of token t at position t.

    Logits at position t-1 predict token t; position 0 has no prediction and gets 0 (records.py).
    """
    logp, ent = vocab_parallel_logprobs_entropy(logits[:, :-1], tokens[:, 1:], vocab_size, with_entropy)
    zero = logp.new_zeros(logp.shape[0], 1)
    return torch.cat([zero, logp], dim=1), torch.cat([zero, ent], dim=1)
