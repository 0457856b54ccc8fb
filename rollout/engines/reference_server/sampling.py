"""Token sampling for the reference server, and the logprob it reports.

The reported logprob of a sampled token y is the behaviour policy the trainer's importance ratio
divides by, computed at the sampling temperature T and WITHOUT top-p/top-k/min-p truncation::

    logprob(y) = log_softmax(logits / T)[y]          (T = 1 for greedy, T = 0)

so a trainer evaluating ``log_softmax(logits / T)`` on the same weights gets ratio 1 on-policy. The
truncations only decide which tokens may be drawn: top-k keeps the k largest probabilities, top-p
keeps the smallest prefix of the sorted distribution whose mass reaches p (always >= 1 token), min-p
drops tokens below ``min_p * max_prob``; the kept probabilities are renormalised and sampled.
Ties at the top-k boundary are broken by sort order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: Optional[int] = None


def make_generator(seed: Optional[int]) -> torch.Generator:
    """A per-request generator: seeded requests replay exactly, unseeded ones draw a fresh seed."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def scaled_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] fp32 logits, [rows] temperatures -> log_softmax(logits / T); T <= 0 counts as 1."""
    temp = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    return torch.log_softmax(logits.float() / temp[:, None], dim=-1)


def keep_mask(sorted_probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] probabilities sorted descending -> bool mask of the tokens each row may draw.

    top-k keeps ranks < k; top-p keeps a sorted token while the kept mass before it is below
    ``top_p * (mass kept by top-k)`` (so the first token always stays); min-p keeps tokens with
    ``p >= min_p * p_max``.
    """
    rows, vocab = sorted_probs.shape
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=sorted_probs.dtype)
    min_p = torch.tensor([p.min_p for p in params], dtype=sorted_probs.dtype)
    keep = torch.arange(vocab)[None, :] < top_k[:, None]
    kept = sorted_probs * keep
    mass_before = torch.cumsum(kept, dim=-1) - kept
    keep &= mass_before < top_p[:, None] * kept.sum(-1, keepdim=True)
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    return keep


def sample_batch(logprobs: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator]) -> tuple[list[int], list[float]]:
    """One token per row of ``scaled_logprobs`` by inverse CDF over the kept tokens.

    Each row draws one uniform from its own generator (so seeded requests replay exactly whatever
    they are batched with); the rest is vectorised. Returns (tokens, their untruncated logprobs).
    """
    sorted_probs, order = torch.sort(logprobs.exp(), dim=-1, descending=True)
    kept = sorted_probs * keep_mask(sorted_probs, params)
    cdf = torch.cumsum(kept, dim=-1)
    uniform = torch.stack([torch.rand((), generator=g) for g in generators]).to(cdf.dtype)
    index = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=cdf.shape[1] - 1)
    tokens = order.gather(1, index)[:, 0]
    greedy = torch.tensor([p.temperature <= 0 for p in params])
    tokens = torch.where(greedy, logprobs.argmax(dim=-1), tokens)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def truncated_probs(logprobs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's sampling distribution after top-k, top-p and min-p (renormalised)."""
    sorted_probs, order = torch.sort(logprobs.exp(), descending=True)
    kept = sorted_probs * keep_mask(sorted_probs[None], [params])[0]
    return torch.zeros_like(kept).scatter(0, order, kept / kept.sum())


def sample_token(logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """`sample_batch` for one row."""
    tokens, chosen = sample_batch(logprobs[None], [params], [generator])
    return tokens[0], chosen[0]
