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

from typing import Optional

import torch

from .context_parallel import ContextParallel


def _tp_info():
    """(rank, size, group) of tensor parallelism; one rank when Megatron's groups do not exist."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, None
    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group())


def _tp_sum(x: torch.Tensor, size: int) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x) if size > 1 else x


def vocab_parallel_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                    with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V/tp] (this rank's slice), targets [...] global ids -> (logp [...], entropy [...]).

    Differentiable w.r.t. `logits`; float32 throughout. `vocab_size` is the real (unpadded) size.
    """
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
    sum_exp = _tp_sum(exp.sum(dim=-1), size)
    local_t = targets - start
    in_range = (local_t >= 0) & (local_t < part)
    picked = shifted.gather(-1, local_t.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
    target_shifted = _tp_sum(torch.where(in_range, picked, torch.zeros_like(picked)), size)
    log_z = sum_exp.log()
    logp = target_shifted - log_z
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    weighted = _tp_sum(torch.where(valid, exp * shifted.masked_fill(~valid, 0.0), torch.zeros_like(exp)).sum(dim=-1),
                       size)
    entropy = log_z - weighted / sum_exp
    return logp, entropy


def token_logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
                               with_entropy: bool = True, temperature: float = 1.0,
                               cp: Optional[ContextParallel] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's logits [rows, seq_local, V/tp] -> logp/entropy [rows, seq] of token t at position t.

    `tokens` [rows, seq] is the whole (padded) sequence in order; under context parallelism the
    logits are this CP rank's positions (context_parallel.py) and the result is gathered back to
    sequence order on every CP rank. Logits at position t-1 predict token t, so position 0 gets 0
    (records.py). Both come from the sampling distribution softmax(logits / temperature): see
    `tempered`.
    """
    cp = cp or ContextParallel()
    next_tokens = torch.cat([tokens[:, 1:], tokens.new_zeros(tokens.shape[0], 1)], dim=1)  # last: no next token
    logp, ent = vocab_parallel_logprobs_entropy(tempered(logits, temperature), cp.split(next_tokens), vocab_size,
                                                with_entropy)
    return shift_to_tokens(cp.gather(logp)), shift_to_tokens(cp.gather(ent))


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T: the engine samples from softmax(logits / T) and reports log_softmax(logits / T)
    without top-p/top-k truncation (SGLang 0.5.23 layers/sampler.py, the reference server alike), so
    the trainer's pi is the tempered distribution and the on-policy ratio is 1 at any T. Entropy is
    that same distribution's: the entropy bonus and metric describe the policy that samples."""
    if temperature <= 0:
        raise ValueError(f"rollout.temperature = {temperature}: the trainer needs T > 0 (greedy is not a policy)")
    return logits if temperature == 1.0 else logits.float() / temperature


def shift_to_tokens(per_position: torch.Tensor) -> torch.Tensor:
    """[rows, seq] values computed at position t (about token t+1) -> stored at t+1; position 0 is 0."""
    zero = per_position.new_zeros(per_position.shape[0], 1)
    return torch.cat([zero, per_position[:, :-1]], dim=1)
