"""Critic loss: masked MSE with optional PPO-style value clipping, normalised by the global token count.

loss = sum_t m_t * e_t / N,  e_t = (V_t - R_t)^2, or with clipping (range c, old values V_old):
e_t = max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - R_t)^2)
Sources: SAO arXiv 2607.07508 (plain masked MSE on lambda_critic = 1 returns); value clipping as in
OpenAI baselines PPO2 / arXiv 2005.12729 §3. No 1/2 factor: SAO states a plain MSE.

Metrics (additive as in aggregation.py): vf_loss, vf_clipfrac, value_mean, return_mean, return_sq_mean,
vf_resid_mean, vf_resid_sq_mean (the moments from which ``finalize_metrics`` computes the step's explained
variance). ``vf_explained_var`` = 1 - Var(R - V) / Var(R) over *this call's* action tokens (population
variances, tokens not sequences, so one sequence of several tokens is enough: Known bug 8); NaN when
every return is equal. It is NOT additive: combine micro-batches with ``combine_metrics``.
"""
from __future__ import annotations

from typing import Optional

import torch

from sao_megatron.core.records import LossOutputs

from .aggregation import Aggregation


def compute_value_loss(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
                       old_values: Optional[torch.Tensor] = None, value_clip: Optional[float] = None,
                       global_num_tokens: Optional[float] = None) -> LossOutputs:
    """Masked (optionally clipped) MSE between ``values`` (with gradient) and ``returns`` (targets)."""
    if value_clip is not None and (old_values is None or value_clip <= 0):
        raise ValueError(f"critic.value_clip={value_clip} needs old_values and a positive range; fix: pass the "
                         "critic's values from before this step, or set critic.value_clip = None")
    agg = Aggregation("token-mean", global_num_tokens)
    keep = mask > 0
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    v = torch.where(keep, values.to(torch.float32), zero)
    ret = torch.where(keep, returns.detach().to(torch.float32), zero)
    err = (v - ret) ** 2
    clipped_on = torch.zeros_like(keep)
    if value_clip is not None:
        old = torch.where(keep, old_values.detach().to(torch.float32), zero)
        err_clip = (old + (v - old).clamp(-value_clip, value_clip) - ret) ** 2
        clipped_on = keep & (err_clip > err)
        err = torch.maximum(err, err_clip)
    loss = agg.loss(err, keep)
    resid = (ret - v).detach()
    metrics = {"vf_loss": loss.detach(), "vf_clipfrac": agg.token_mean(clipped_on.float(), keep),
               "value_mean": agg.token_mean(v, keep), "return_mean": agg.token_mean(ret, keep),
               "return_sq_mean": agg.token_mean(ret * ret, keep), "vf_resid_mean": agg.token_mean(resid, keep),
               "vf_resid_sq_mean": agg.token_mean(resid * resid, keep),
               "vf_explained_var": explained_variance(v.detach(), ret, keep)}
    return LossOutputs(loss, metrics)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over action tokens (population variances, two-pass, float64); NaN if
    Var(R) = 0. Returns a 0-d tensor."""
    keep = mask > 0
    n = keep.sum().clamp_min(1).to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    ret = torch.where(keep, returns.detach().to(torch.float64), zero)
    resid = torch.where(keep, ret - values.detach().to(torch.float64), zero)

    def var(x):
        mean = x.sum() / n
        return float(torch.where(keep, (x - mean) ** 2, zero).sum() / n), float((x * x).sum() / n)

    var_r, r_sq_mean = var(ret)
    var_e, _ = var(resid)
    if var_r <= 1e-12 * max(1.0, r_sq_mean):
        return torch.tensor(float("nan"))
    return torch.tensor(1.0 - var_e / var_r)
