"""The named steps of one RL iteration: advantages, the KL to the reference, and the loss functions the
model's schedule calls."""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from sao_megatron.core.config import AlgorithmConfig, CriticConfig
from sao_megatron.core.records import AdvantageBatch, LossInputs, LossOutputs, Sample, TrainBatch


def compute_step_advantages(cfg: AlgorithmConfig, batch: AdvantageBatch):
    """Advantages [B, R], critic returns [B, R] (or None) and metrics for one batch of samples."""
    from sao_megatron.algorithms import compute_advantages
    from sao_megatron.metrics.learning import critic_prediction_metrics

    advantages, returns, metrics = compute_advantages(
        cfg, token_rewards=batch.token_rewards, mask=batch.mask, values=batch.values, seq_rewards=batch.seq_rewards,
        group_ids=batch.group_ids, response_lengths=batch.response_lengths, baseline=batch.baseline)
    # the critic's values here predate its update on this batch: an out-of-sample check of the critic
    return advantages, returns, {**metrics, **critic_prediction_metrics(batch.values, returns, batch.mask)}


class ReferenceLogprobs(NamedTuple):
    """Per micro-batch [rows, seq]: the reference's logprobs, and the policy's (kl_in = reward only)."""

    reference: list
    policy: Optional[list] = None


def kl_in_reward(cfg: AlgorithmConfig, batch: AdvantageBatch, policy_logp: torch.Tensor,
                 ref_logp: torch.Tensor) -> tuple[AdvantageBatch, dict]:
    """algorithm.kl_in = reward: r_t <- r_t - kl_coef * k_t on action tokens (algorithms/kl.py
    apply_kl_penalty; [B, R] response space), and ref_kl, the token mean of k_t."""
    from sao_megatron.algorithms.kl import apply_kl_penalty, kl_estimate

    rewards = apply_kl_penalty(batch.token_rewards, policy_logp, ref_logp, batch.mask, cfg.kl_coef, cfg.kl_estimator)
    keep = batch.mask > 0
    kl = kl_estimate(policy_logp, ref_logp, cfg.kl_estimator)[keep]
    return replace(batch, token_rewards=rewards), {"ref_kl": kl.mean().item() if kl.numel() else 0.0}


def renamed_kl(metrics: dict) -> dict:
    """The loss's KL to the reference (algorithms/compose.py 'kl') under its run-metric name, ref_kl."""
    if "kl" not in metrics:
        return metrics
    metrics = dict(metrics)
    metrics["ref_kl"] = metrics.pop("kl")
    return metrics


def policy_loss_fn(cfg: AlgorithmConfig, norm_len: float):
    """loss_fn(batch, outputs) for RLModel.train_step: the configured policy loss plus the mismatch metric.

    `norm_len` is the constant L of seq-mean-token-sum-norm (Dr.GRPO): the response token budget.
    """
    from sao_megatron.algorithms import compute_policy_loss

    if cfg.kl_in == "reward":   # the KL is in the advantages already (kl_in_reward), not a loss term
        cfg = replace(cfg, kl_coef=0.0)

    def loss_fn(batch: TrainBatch, outputs: dict) -> LossOutputs:
        logp = outputs["logp"]
        inputs = LossInputs(
            logp=logp, rollout_logp=batch.rollout_logprobs, advantages=batch.advantages, mask=batch.loss_mask,
            old_logp=batch.old_logprobs, ref_logp=batch.ref_logprobs, entropy=outputs.get("entropy"),
            global_num_tokens=batch.global_num_tokens, global_num_seqs=batch.global_num_seqs)
        out = compute_policy_loss(cfg, inputs, norm_len=norm_len)
        # |logp_train - logp_rollout| over action tokens, scaled so micro-batches add up to the step mean.
        diff = ((logp.detach() - batch.rollout_logprobs).abs() * batch.loss_mask).sum()
        out.metrics["train_rollout_logprob_abs_diff"] = diff / max(batch.global_num_tokens, 1.0)
        return out

    return loss_fn


def value_loss_fn(cfg: CriticConfig):
    from sao_megatron.algorithms import compute_value_loss

    def loss_fn(batch: TrainBatch, outputs: dict) -> LossOutputs:
        return compute_value_loss(outputs["values"], batch.returns, batch.loss_mask, old_values=batch.old_values,
                                  value_clip=cfg.value_clip, global_num_tokens=batch.global_num_tokens)

    return loss_fn


def rollout_metrics(samples: list[Sample], version: int) -> dict:
    """rollout/* numbers of the samples a step trained on: the sample sources' own computation
    (rollout/batch_metrics.py), so a log line's values agree whichever of the two wrote them."""
    from rollout.batch_metrics import batch_metrics

    return batch_metrics(samples, version)


def prefixed(prefix: str, metrics: dict) -> dict:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = value.item()
        out[key if "/" in key else f"{prefix}/{key}"] = value
    return out
