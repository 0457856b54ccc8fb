"""The trainer's entry points: one policy loss (loss + correction + KL + entropy) and one advantage pass.

``compute_policy_loss`` = loss(cfg.loss) with the correction weight (cfg.correction) on every token,
+ kl_coef * agg(KL term) when reference logprobs are given, - entropy_coef * agg(entropy) when entropy is
given, all aggregated by cfg.loss_agg over the step's global counts. Metrics are additive across
micro-batches and DP ranks except ``*_max``/``*_min`` and ``vf_explained_var`` (aggregation.combine_metrics).
"""
from __future__ import annotations

from typing import Optional

import torch

from sao_megatron.core.records import LossInputs, LossOutputs

from .advantages import overlong_penalty, dynamic_sampling_filter, place_scalar_reward
from .aggregation import Aggregation
from .corrections import correction_weights
from .kl import kl_estimate, kl_loss_term
from .registry import AdvantageBatch, get_advantage_estimator, get_policy_loss


def compute_policy_loss(cfg, inputs: LossInputs, *, norm_len: Optional[float] = None) -> LossOutputs:
    """Policy loss for one micro-batch. ``cfg`` is an AlgorithmConfig; ``norm_len`` is the constant L of
    ``seq-mean-token-sum-norm`` (default: the padded width; pass the generation budget for split-invariance).

    Metrics: pg_loss, pg_clipfrac(_low/_high), ppo_kl, ratio_mean/max/min (from the loss), mismatch_kl and
    tis_weight_* / tis_maskfrac (correction), kl (when ref_logp given), entropy (when entropy given), loss.
    """
    agg = Aggregation(cfg.loss_agg, inputs.global_num_tokens, inputs.global_num_seqs, norm_len)
    keep = inputs.mask > 0
    train_logp = inputs.old_logp if inputs.old_logp is not None else inputs.logp
    weight, metrics = correction_weights(cfg.correction, train_logp, inputs.rollout_logp, inputs.mask,
                                         low=cfg.correction_low, high=cfg.correction_high,
                                         level=cfg.correction_level, agg=agg)
    out = get_policy_loss(cfg.loss or cfg.name)(cfg, inputs, agg, weight)
    loss = out.loss
    metrics.update(out.metrics)
    loss = loss + _kl_term(cfg, inputs, agg, keep, metrics)
    loss = loss - _entropy_term(cfg, inputs, agg, keep, metrics)
    metrics["loss"] = loss.detach()
    return LossOutputs(loss, metrics)


def _zeroed(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, x.to(torch.float32), torch.zeros((), dtype=torch.float32, device=keep.device))


def _kl_term(cfg, inputs, agg, keep, metrics) -> torch.Tensor:
    if inputs.ref_logp is None:
        if cfg.kl_coef:
            raise ValueError(f"algorithm.kl_coef={cfg.kl_coef} needs reference logprobs (inputs.ref_logp is None); "
                             "fix: compute ref logprobs or set algorithm.kl_coef = 0")
        return torch.zeros((), device=keep.device)
    logp, ref = _zeroed(inputs.logp, keep), _zeroed(inputs.ref_logp, keep)
    metrics["kl"] = agg.token_mean(kl_estimate(logp.detach(), ref, cfg.kl_estimator), keep)
    if not cfg.kl_coef:
        return torch.zeros((), device=keep.device)
    return cfg.kl_coef * agg.loss(kl_loss_term(logp, ref, cfg.kl_estimator), keep)


def _entropy_term(cfg, inputs, agg, keep, metrics) -> torch.Tensor:
    if inputs.entropy is None:
        if cfg.entropy_coef:
            raise ValueError(f"algorithm.entropy_coef={cfg.entropy_coef} needs per-token entropy (inputs.entropy "
                             "is None); fix: have the trainer compute entropy or set algorithm.entropy_coef = 0")
        return torch.zeros((), device=keep.device)
    entropy = _zeroed(inputs.entropy, keep)
    metrics["entropy"] = agg.token_mean(entropy, keep)
    if not cfg.entropy_coef:
        return torch.zeros((), device=keep.device)
    return cfg.entropy_coef * agg.loss(entropy, keep)


@torch.no_grad()
def compute_advantages(cfg, *, token_rewards: torch.Tensor, mask: torch.Tensor, values: Optional[torch.Tensor] = None,
                       seq_rewards: torch.Tensor, group_ids: torch.Tensor, response_lengths: torch.Tensor,
                       baseline: Optional[float] = None):
    """Advantages for one step -> (advantages [B, T], returns [B, T] or None, metrics).

    'gae': decoupled lambda -- policy advantages with cfg.lambda_actor, or the length-adaptive
    1 - 1/(cfg.alpha * l) when it is None; critic returns with cfg.lambda_critic. Group estimators give
    token-broadcast advantages and returns=None. With cfg.overlong_max > 0 the DAPO overlong penalty is
    added to seq_rewards and to the reward on each row's last action token first. Metrics: adv_mean,
    adv_std, adv_max, adv_min (over action tokens), reward_mean, return_mean (gae), lambda_actor_mean
    (gae), overlong_penalty_mean (if on), ds_keep_frac (if cfg.dynamic_sampling: share of samples whose
    group has a reward spread; the buffer drops the rest with dynamic_sampling_filter), running_baseline
    ('running_mean': the baseline the caller passes as `baseline` next step).
    """
    _check_advantage_inputs(token_rewards, mask, values, seq_rewards, group_ids, response_lengths)
    metrics = {}
    if cfg.overlong_max > 0:
        penalty = overlong_penalty(response_lengths, cfg.overlong_max, cfg.overlong_cache)
        seq_rewards = seq_rewards.to(torch.float32) + penalty
        token_rewards = token_rewards.to(torch.float32) + place_scalar_reward(penalty, mask)
        metrics["overlong_penalty_mean"] = float(penalty.mean())
    batch = AdvantageBatch(token_rewards, mask, values, seq_rewards, group_ids, response_lengths, baseline)
    advantages, returns, extra = get_advantage_estimator(cfg.advantage or cfg.name)(cfg, batch)
    metrics.update(extra)
    metrics.update(_advantage_metrics(advantages, returns, mask, seq_rewards))
    if cfg.dynamic_sampling:
        metrics["ds_keep_frac"] = float(dynamic_sampling_filter(seq_rewards, group_ids).float().mean())
    return advantages, returns, metrics


def _check_advantage_inputs(token_rewards, mask, values, seq_rewards, group_ids, response_lengths) -> None:
    if token_rewards.shape != mask.shape or (values is not None and values.shape != mask.shape):
        raise ValueError(f"compute_advantages: token_rewards {tuple(token_rewards.shape)}, mask {tuple(mask.shape)} "
                         f"and values must all be [B, T]; fix: pass tensors over the same response positions")
    rows = mask.shape[0]
    for name, x in (("seq_rewards", seq_rewards), ("group_ids", group_ids), ("response_lengths", response_lengths)):
        if x.shape != (rows,):
            raise ValueError(f"compute_advantages: {name} has shape {tuple(x.shape)}, expected [{rows}]")
    # Known bug 4: a reward on padding after EOS (or on an observation token) would be silently ignored.
    stray = (token_rewards != 0) & ~(mask > 0)
    if bool(stray.any()):
        row, col = (int(i) for i in torch.nonzero(stray)[0])
        raise ValueError(f"compute_advantages: token_rewards[{row}, {col}] = {float(token_rewards[row, col])} sits "
                         "on a mask-0 position (padding or observation); fix: put each reward on the last action "
                         "token (algorithms.place_scalar_reward)")


def _advantage_metrics(advantages, returns, mask, seq_rewards) -> dict:
    keep = mask > 0
    vals = advantages[keep]
    out = {"reward_mean": float(seq_rewards.float().mean()) if seq_rewards.numel() else 0.0,
           "adv_mean": float(vals.mean()) if vals.numel() else 0.0,
           "adv_std": float(vals.std()) if vals.numel() > 1 else 0.0,
           "adv_max": float(vals.max()) if vals.numel() else 0.0,
           "adv_min": float(vals.min()) if vals.numel() else 0.0}
    if returns is not None:
        out["return_mean"] = float(returns[keep].mean()) if vals.numel() else 0.0
    return out
