"""Token sampling for the reference server, and the logprob it reports.

The reported logprob of a sampled token y is the behaviour policy the trainer's importance ratio
divides by, computed at the sampling temperature T and WITHOUT top-p/top-k/min-p truncation::

    logprob(y) = log_softmax(logits / T)[y]          (T = 1 for greedy, T = 0)

so a trainer evaluating ``log_softmax(logits / T)`` on the same weights gets ratio 1 on-policy. The
truncations only decide which tokens may be drawn: top-k keeps the k largest probabilities, top-p
keeps the smallest prefix of the sorted distribution whose mass reaches p (always >= 1 token), min-p
drops tokens below ``min_p * max_prob``; the kept probabilities are renormalised and sampled.
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


def truncated_probs(logprobs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's sampling distribution after top-k, top-p and min-p (renormalised)."""
    probs = logprobs.exp()
    if 0 < params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
        keep_sorted = mass_before < params.top_p * sorted_probs.sum()   # first token always kept
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()


def sample_token(logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """Draw one token from a row of ``scaled_logprobs``; returns (token, its untruncated logprob)."""
    if params.temperature <= 0:
        token = int(torch.argmax(logprobs))
    else:
        token = int(torch.multinomial(truncated_probs(logprobs, params), 1, generator=generator))
    return token, float(logprobs[token])
