"""Pure-torch RL algorithms: policy losses, advantages, value loss, corrections, KL, aggregation.

No Megatron import anywhere in this package: everything is tested on CPU in milliseconds. The trainer
calls three entry points: ``compute_policy_loss``, ``compute_advantages``, ``compute_value_loss``; and
combines micro-batch metrics with ``combine_metrics``. Formulas and sources: docs/algorithms.md.
"""
from .advantages import (broadcast_to_tokens, compute_gae, drgrpo_advantages, dynamic_sampling_filter,
                         grpo_advantages, group_stats, length_adaptive_lambda, overlong_penalty, place_scalar_reward,
                         reinforce_pp_advantages, reinforce_pp_baseline_advantages, rloo_advantages,
                         running_mean_advantages, whiten)
from .aggregation import AGG_MODES, Aggregation, aggregate_loss, combine_metrics, finalize_metrics, reduction
from .compose import compute_advantages, compute_policy_loss
from .corrections import CORRECTIONS, correction_weights
from .kl import KL_ESTIMATORS, apply_kl_penalty, kl_estimate, kl_loss_term, kl_penalty
from .policy_losses import cispo_loss, dis_loss, gspo_loss, gspo_token_loss, policy_gradient_loss, ppo_clip_loss
from .registry import (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, AdvantageBatch, get_advantage_estimator,
                       get_policy_loss)
from .value_loss import compute_value_loss, explained_variance

__all__ = [
    "compute_policy_loss", "compute_advantages", "compute_value_loss", "combine_metrics", "finalize_metrics",
    "reduction",
    "dis_loss", "ppo_clip_loss", "gspo_loss", "gspo_token_loss", "cispo_loss", "policy_gradient_loss",
    "compute_gae", "length_adaptive_lambda", "place_scalar_reward", "grpo_advantages", "drgrpo_advantages",
    "rloo_advantages", "running_mean_advantages", "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "whiten", "group_stats",
    "broadcast_to_tokens", "dynamic_sampling_filter", "overlong_penalty", "Aggregation", "aggregate_loss",
    "AGG_MODES", "correction_weights", "CORRECTIONS", "kl_estimate", "kl_loss_term", "kl_penalty",
    "apply_kl_penalty", "KL_ESTIMATORS", "POLICY_LOSSES", "ADVANTAGE_ESTIMATORS", "AdvantageBatch",
    "get_policy_loss", "get_advantage_estimator", "explained_variance",
]
