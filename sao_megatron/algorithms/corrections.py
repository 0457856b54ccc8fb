"""Train/inference mismatch corrections, applied as a detached per-token weight on top of any loss.

The rollout engine (SGLang, other kernels, FP8, other expert routes) samples from pi_rollout, while the
trainer computes pi_train for the *same* weights; rho_t = pi_train(y_t) / pi_rollout(y_t) measures the
mismatch. pi_train is the trainer's logprob before this step's update (``LossInputs.old_logp``) or, when
the trainer skipped that forward pass, the current logp (detached; equal to it on the first mini-batch).

- ``tis``    w = min(rho, C), C = correction_high                       (token; or sequence, see below)
- ``mis``    w = rho * 1[C_low <= rho <= C_high]  (masked IS: outliers are dropped, not truncated)
- ``icepop`` w = rho * 1[alpha <= rho <= beta], token level, alpha/beta = correction_low/high
Sequence level (``correction_level='sequence'``, TIS and MIS): rho_i = exp(sum_t log rho_it), the
sequence importance ratio, is used for every token of sequence i.

Sources: TIS / MIS: F. Yao, L. Liu et al., "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training" (2025 blog) and its follow-up on masked IS; IcePop: Ling team, Ring-1T report
("Every Step Evolves", Oct 2025), M(k) = k on [alpha, beta] else 0. Token-level MIS and IcePop
coincide in formula; they keep separate names because recipes cite them with different bands
(MIS [0.5, 2], IcePop [0.5, 5]).

Masked tokens keep their place in the loss denominator (the global counts are fixed before the forward
pass), so a dropped token lowers the step's effective size rather than re-weighting the others.
Metrics (additive): tis_weight_mean, tis_maskfrac (share of tokens with weight 0 from the band),
tis_weight_max/min, mismatch_kl = token mean of (rollout_logp - train_logp), the k1 estimate of
KL(pi_rollout || pi_train).
"""
from __future__ import annotations

from typing import Optional

import torch

from .aggregation import Aggregation

CORRECTIONS = ("none", "tis", "mis", "icepop")


def correction_weights(kind: str, train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *,
                       low: float = 0.5, high: float = 2.0, level: str = "token",
                       agg: Optional[Aggregation] = None) -> tuple[Optional[torch.Tensor], dict]:
    """Detached weights ``[B, T]`` (None for kind 'none') and additive metrics. Formulas: module doc."""
    if kind not in CORRECTIONS:
        raise ValueError(f"algorithm.correction: unknown {kind!r}; fix: use one of {', '.join(CORRECTIONS)}")
    if level not in ("token", "sequence"):
        raise ValueError(f"algorithm.correction_level: unknown {level!r}; fix: use 'token' or 'sequence'")
    agg = agg or Aggregation()
    keep = mask > 0
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_rho = torch.where(keep, train_logp.detach().float() - rollout_logp.float(), zero)
    metrics = {"mismatch_kl": agg.token_mean(-log_rho, keep)}
    if kind == "none":
        return None, metrics
    if level == "sequence" and kind != "icepop":
        log_rho = torch.where(keep, log_rho.sum(-1, keepdim=True).expand_as(log_rho), zero)
    rho = torch.exp(log_rho.clamp(max=80.0))  # exp(80) is finite in float32; beyond, every band rejects it
    if kind == "tis":
        weight, dropped = rho.clamp(max=high), torch.zeros_like(keep)
    else:
        inside = (rho >= low) & (rho <= high)
        weight, dropped = torch.where(inside, rho, zero), keep & ~inside
    weight = torch.where(keep, weight, zero)
    metrics.update(_weight_metrics(agg, weight, keep, dropped))
    return weight, metrics


def _weight_metrics(agg: Aggregation, weight: torch.Tensor, keep: torch.Tensor, dropped: torch.Tensor) -> dict:
    big = torch.finfo(torch.float32).max
    any_token = bool(keep.any())
    return {"tis_weight_mean": agg.token_mean(weight, keep),
            "tis_maskfrac": agg.token_mean(dropped.float(), keep),
            "tis_weight_max": torch.where(keep, weight, -big).max() if any_token else torch.tensor(1.0),
            "tis_weight_min": torch.where(keep, weight, big).min() if any_token else torch.tensor(1.0)}
