"""Policy losses: DIS (SAO), PPO clip (clip-higher, dual-clip), GSPO, GSPO-token, CISPO.

Shared conventions. Inputs are ``[batch, seq]``; ``mask`` is 1 on action tokens. Every function
- computes in float32 (a bf16 ratio exp(logp - old) is too coarse for bands like 1 +- 3e-4);
- zeroes masked positions *before* any arithmetic, so padding holding garbage (even NaN or inf) changes
  neither the loss nor any gradient;
- multiplies the per-token loss by an optional detached ``token_weight`` (train/inference corrections,
  corrections.py) and aggregates it with an ``Aggregation`` (global denominators, aggregation.py);
- returns ``LossOutputs(loss, metrics)`` with additive metrics (see aggregation.py): pg_loss,
  pg_clipfrac, pg_clipfrac_low, pg_clipfrac_high, ppo_kl (token mean of old_logp - logp, the k1 estimate
  of KL(behaviour || current)), ratio_mean, ratio_max, ratio_min.
Losses are to be *minimised*: each is the negative of its paper's objective.
"""
from __future__ import annotations

from typing import Optional

import torch

from sao_megatron.core.records import LossOutputs

from .aggregation import Aggregation


def _prepare(mask: torch.Tensor, *tensors: torch.Tensor):
    """Bool action mask and float32 copies of ``tensors`` with masked positions set to 0."""
    keep = mask > 0
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    return keep, [torch.where(keep, t.to(torch.float32), zero) for t in tensors]


def _weighted(per_token: torch.Tensor, token_weight: Optional[torch.Tensor], keep: torch.Tensor):
    if token_weight is None:
        return per_token
    weight = torch.where(keep, token_weight.detach().to(torch.float32), torch.zeros_like(per_token))
    return per_token * weight


def _check_band(name: str, eps_low, eps_high) -> None:
    # Known bug 7: eps_high must never silently default to eps_low.
    for field, value in (("eps_low", eps_low), ("eps_high", eps_high)):
        if value is None or value <= 0:
            raise ValueError(f"algorithm.{field}: {value!r} for the {name} loss; fix: set a positive "
                             f"algorithm.{field} (it never defaults to the other side)")


def _ratio_metrics(agg: Aggregation, ratio: torch.Tensor, keep: torch.Tensor,
                   logp: torch.Tensor, behaviour_logp: torch.Tensor) -> dict:
    ratio = ratio.detach()
    big = torch.finfo(torch.float32).max
    any_token = bool(keep.any())
    return {
        "ratio_mean": agg.token_mean(ratio, keep),
        "ratio_max": torch.where(keep, ratio, -big).max() if any_token else torch.tensor(1.0),
        "ratio_min": torch.where(keep, ratio, big).min() if any_token else torch.tensor(1.0),
        "ppo_kl": agg.token_mean(behaviour_logp - logp.detach(), keep),
    }


def _clip_metrics(agg, keep, low, high, **extra) -> dict:
    out = {"pg_clipfrac": agg.token_mean((low | high).float(), keep),
           "pg_clipfrac_low": agg.token_mean(low.float(), keep),
           "pg_clipfrac_high": agg.token_mean(high.float(), keep)}
    out.update({k: agg.token_mean(v.float(), keep) for k, v in extra.items()})
    return out


def dis_loss(logp, rollout_logp, advantages, mask, eps_low: float, eps_high: float, *,
             normalize_over: str = "all", token_weight=None, agg: Optional[Aggregation] = None) -> LossOutputs:
    """SAO's Direct Double-sided Importance Sampling: strict double-sided token-level masking.

    r_t = exp(logp_t - rollout_logp_t)   (behaviour = the rollout engine's own logprobs; no pi_old)
    w_t = sg(r_t) if 1 - eps_low < r_t < 1 + eps_high (strict) else 0, whatever the sign of A_t
    loss = agg(-w_t * A_t * logp_t)      so grad = -w_t A_t grad logp_t = -A_t grad r_t inside the band.

    Sources: GLM-5 report arXiv 2602.15763 §4.1 (DIS); SAO arXiv 2607.07508 (used with a value model).
    Bands: reasoning (eps_low, eps_high) = (0.3, 5.0) -> r in (0.7, 6.0); coding (0.8, 3.0) -> (0.2, 4.0).
    ``normalize_over``: 'all' (default; every action token counts in the denominator, so masking a token
    shrinks the step) or 'kept' (only in-band tokens count; under several micro-batches the global kept
    count is estimated from each micro-batch's kept fraction). The paper does not say; 'all' keeps the
    loss split-invariant. Extra metrics: pg_clipfrac_low = share with r <= 1 - eps_low (masked below),
    pg_clipfrac_high = share with r >= 1 + eps_high (masked above).
    """
    _check_band("dis", eps_low, eps_high)
    if normalize_over not in ("all", "kept"):
        raise ValueError(f"algorithm.normalize_over: {normalize_over!r}; fix: use 'all' or 'kept'")
    agg = agg or Aggregation()
    keep, (logp, rollout_logp, adv) = _prepare(mask, logp, rollout_logp, advantages)
    ratio = torch.exp(logp.detach() - rollout_logp)
    below = keep & (ratio <= 1.0 - eps_low)
    above = keep & (ratio >= 1.0 + eps_high)
    kept = keep & ~below & ~above
    weight = torch.where(kept, ratio, torch.zeros_like(ratio))   # detached: ratio came from logp.detach()
    per_token = _weighted(-weight * adv * logp, token_weight, keep)
    loss = agg.loss(per_token, keep, kept if normalize_over == "kept" else None)
    metrics = {"pg_loss": loss.detach(), **_clip_metrics(agg, keep, below, above),
               **_ratio_metrics(agg, ratio, keep, logp, rollout_logp)}
    return LossOutputs(loss, metrics)


def ppo_clip_loss(logp, old_logp, advantages, mask, eps_low: float, eps_high: float, *,
                  dual_clip: Optional[float] = None, token_weight=None,
                  agg: Optional[Aggregation] = None) -> LossOutputs:
    """PPO clipped surrogate with asymmetric bounds (clip-higher) and optional dual-clip.

    r_t = exp(logp_t - old_logp_t);  l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
    dual-clip (A_t < 0 only): l_t = min(l_t, -c A_t), c > 1.
    Sources: PPO arXiv 1707.06347 eq. 7; clip-higher DAPO arXiv 2503.14476 §3.1; dual-clip arXiv
    1912.09729 eq. 5. pg_clipfrac = share of tokens where the clipped term is the larger loss (its
    gradient is 0); low side = those with r < 1 - eps_low, high side = r > 1 + eps_high;
    pg_clipfrac_dual = share where the dual-clip bound is active.
    """
    _check_band("ppo", eps_low, eps_high)
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"algorithm.dual_clip: {dual_clip} must be > 1; fix: use 3.0 or leave it unset")
    agg = agg or Aggregation()
    keep, (logp, old_logp, adv) = _prepare(mask, logp, old_logp, advantages)
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_on = keep & (clipped > unclipped)
    dual_on = torch.zeros_like(keep)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_on = keep & (adv < 0) & (per_token > bound)
        per_token = torch.where(dual_on, bound, per_token)
    per_token = _weighted(per_token, token_weight, keep)
    loss = agg.loss(per_token, keep)
    r = ratio.detach()
    metrics = {"pg_loss": loss.detach(),
               **_clip_metrics(agg, keep, clip_on & (r < 1.0 - eps_low), clip_on & (r > 1.0 + eps_high),
                               pg_clipfrac_dual=dual_on),
               **_ratio_metrics(agg, ratio, keep, logp, old_logp)}
    return LossOutputs(loss, metrics)


def _seq_mean(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per-row mean over action tokens (0 for rows without any); ``x`` already zero where masked."""
    return x.sum(-1) / keep.sum(-1).clamp_min(1)


def _clip_objective(adv, s, eps_low, eps_high):
    unclipped = -adv * s
    clipped = -adv * s.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def gspo_loss(logp, old_logp, advantages, mask, eps_low: float, eps_high: float, *, token_weight=None,
              agg: Optional[Aggregation] = None) -> LossOutputs:
    """GSPO: sequence-level ratio and clipping (arXiv 2507.18071, §4.1).

    s_i = exp( (1/|y_i|) sum_t (logp_it - old_logp_it) );  A_i = mean over the sequence's action tokens
    l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))    (paper ranges 3e-4 / 4e-4)
    l_i is placed on every action token of sequence i and aggregated like any loss: with
    ``seq-mean-token-mean`` this is exactly the paper's mean over sequences; with ``token-mean`` each
    sequence weighs by its length. ratio_* metrics describe s_i (token-weighted); pg_clipfrac is the share
    of tokens whose sequence is clipped.
    """
    _check_band("gspo", eps_low, eps_high)
    agg = agg or Aggregation()
    keep, (logp, old_logp, adv) = _prepare(mask, logp, old_logp, advantages)
    s = torch.exp(_seq_mean(logp - old_logp, keep))                     # [B], carries the gradient
    seq_loss, clip_on = _clip_objective(_seq_mean(adv, keep), s, eps_low, eps_high)
    per_token = _weighted(seq_loss[:, None].expand_as(logp), token_weight, keep)
    loss = agg.loss(per_token, keep)
    s_tok = s.detach()[:, None].expand_as(logp)
    clip_tok = keep & clip_on[:, None]
    metrics = {"pg_loss": loss.detach(),
               **_clip_metrics(agg, keep, clip_tok & (s_tok < 1.0 - eps_low), clip_tok & (s_tok > 1.0 + eps_high)),
               **_ratio_metrics(agg, s_tok, keep, logp, old_logp)}
    return LossOutputs(loss, metrics)


def gspo_token_loss(logp, old_logp, advantages, mask, eps_low: float, eps_high: float, *,
                    token_weight=None, agg: Optional[Aggregation] = None) -> LossOutputs:
    """GSPO-token (arXiv 2507.18071, §4.3): per-token advantages with the sequence ratio's value.

    log s_it = logp_it - sg(logp_it) + sg( (1/|y_i|) sum_t (logp_it - old_logp_it) )
    l_it = max(-A_it s_it, -A_it clip(s_it, 1 - eps_low, 1 + eps_high))
    s_it equals s_i in value but its gradient is s_i grad logp_it, so with A_it = A_i for all t the
    gradient equals GSPO's under any aggregation (tested).
    """
    _check_band("gspo_token", eps_low, eps_high)
    agg = agg or Aggregation()
    keep, (logp, old_logp, adv) = _prepare(mask, logp, old_logp, advantages)
    seq_log_ratio = _seq_mean(logp.detach() - old_logp, keep)
    s = torch.exp(logp - logp.detach() + seq_log_ratio[:, None])
    per_token, clip_on = _clip_objective(adv, s, eps_low, eps_high)
    per_token = _weighted(per_token, token_weight, keep)
    loss = agg.loss(per_token, keep)
    clip_on = keep & clip_on
    r = s.detach()
    metrics = {"pg_loss": loss.detach(),
               **_clip_metrics(agg, keep, clip_on & (r < 1.0 - eps_low), clip_on & (r > 1.0 + eps_high)),
               **_ratio_metrics(agg, r, keep, logp, old_logp)}
    return LossOutputs(loss, metrics)


def cispo_loss(logp, old_logp, advantages, mask, eps_low: float, eps_high: float, *, token_weight=None,
               agg: Optional[Aggregation] = None) -> LossOutputs:
    """CISPO (MiniMax-M1, arXiv 2506.13585 §3.1): clip the IS weight, never drop the token's gradient.

    r_t = exp(logp_t - old_logp_t);  l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_t
    (MiniMax use no lower clip: pass eps_low >= 1.) pg_clipfrac = share of tokens whose weight was clipped.
    """
    _check_band("cispo", eps_low, eps_high)
    agg = agg or Aggregation()
    keep, (logp, old_logp, adv) = _prepare(mask, logp, old_logp, advantages)
    ratio = torch.exp(logp.detach() - old_logp)
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = _weighted(-weight * adv * logp, token_weight, keep)
    loss = agg.loss(per_token, keep)
    low, high = keep & (ratio < 1.0 - eps_low), keep & (ratio > 1.0 + eps_high)
    metrics = {"pg_loss": loss.detach(), **_clip_metrics(agg, keep, low, high),
               **_ratio_metrics(agg, ratio, keep, logp, old_logp)}
    return LossOutputs(loss, metrics)


def policy_gradient_loss(logp, advantages, mask, *, agg: Optional[Aggregation] = None) -> LossOutputs:
    """Plain on-policy REINFORCE / policy-gradient loss: agg(-A_t * logp_t) (Williams 1992).

    The reference DIS reduces to when logp == rollout_logp (r = 1 inside every band)."""
    agg = agg or Aggregation()
    keep, (logp, adv) = _prepare(mask, logp, advantages)
    loss = agg.loss(-adv * logp, keep)
    return LossOutputs(loss, {"pg_loss": loss.detach()})
