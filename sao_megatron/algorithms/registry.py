"""Name -> function registries, so a recipe names its loss and advantage estimator by string.

``POLICY_LOSSES`` maps loss names (dis, ppo, gspo, gspo_token, cispo) *and* recipe names (sao, grpo,
grpo_dis, gspo, gspo_token, dapo, drgrpo, rloo, reinforce_pp, ppo; via config/presets.py) to adapters
with the uniform signature ``fn(cfg, inputs, agg, token_weight) -> LossOutputs``. A recipe may instead
give ``'pkg.mod:fn'``: that function must have the same signature (cfg: AlgorithmConfig, inputs:
LossInputs, agg: Aggregation, token_weight: Tensor | None). ``ADVANTAGE_ESTIMATORS`` likewise maps
estimator and recipe names to ``fn(cfg, batch: AdvantageBatch) -> (advantages, returns | None, metrics)``.
"""
from __future__ import annotations

from typing import Callable

import torch

from sao_megatron.core.imports import resolve_import_path
from sao_megatron.core.records import AdvantageBatch   # the one response-space record, re-exported here
from sao_megatron.core.config.presets import PRESETS

from . import advantages as adv
from .policy_losses import cispo_loss, dis_loss, gspo_loss, gspo_token_loss, ppo_clip_loss


def _old(inputs):
    """PPO-family behaviour policy: the trainer's pre-update logprobs, else the rollout engine's."""
    return inputs.old_logp if inputs.old_logp is not None else inputs.rollout_logp


def _dis(cfg, inputs, agg, token_weight):
    return dis_loss(inputs.logp, inputs.rollout_logp, inputs.advantages, inputs.mask, cfg.eps_low, cfg.eps_high,
                    normalize_over=cfg.normalize_over, token_weight=token_weight, agg=agg)


def _ppo(cfg, inputs, agg, token_weight):
    return ppo_clip_loss(inputs.logp, _old(inputs), inputs.advantages, inputs.mask, cfg.eps_low, cfg.eps_high,
                         dual_clip=cfg.dual_clip, token_weight=token_weight, agg=agg)


def _same_signature(fn):
    def adapter(cfg, inputs, agg, token_weight):
        return fn(inputs.logp, _old(inputs), inputs.advantages, inputs.mask, cfg.eps_low, cfg.eps_high,
                  token_weight=token_weight, agg=agg)
    adapter.__name__ = adapter.__qualname__ = f"_{fn.__name__}_adapter"
    adapter.__doc__ = fn.__doc__
    return adapter


_LOSS_FUNCTIONS: dict[str, Callable] = {
    "dis": _dis, "ppo": _ppo, "gspo": _same_signature(gspo_loss),
    "gspo_token": _same_signature(gspo_token_loss), "cispo": _same_signature(cispo_loss),
}


def _gae(cfg, batch: AdvantageBatch):
    if batch.values is None:
        raise ValueError("algorithm.advantage='gae' needs critic values (values=None); fix: enable the critic "
                         "(critic.enabled = true) or pick a group estimator such as 'grpo'")
    if cfg.lambda_actor is not None:
        lam_actor = torch.full(batch.seq_rewards.shape, float(cfg.lambda_actor))
    else:
        lam_actor = adv.length_adaptive_lambda(batch.response_lengths, cfg.alpha)
    lam_actor = lam_actor.to(batch.mask.device)
    advantages, _ = adv.compute_gae(batch.token_rewards, batch.values, batch.mask, cfg.gamma, lam_actor)
    _, returns = adv.compute_gae(batch.token_rewards, batch.values, batch.mask, cfg.gamma, cfg.lambda_critic)
    return advantages, returns, {"lambda_actor_mean": float(lam_actor.mean()) if lam_actor.numel() else 0.0}


def _group(seq_estimator):
    def estimator(cfg, batch: AdvantageBatch):
        seq_adv = seq_estimator(batch.seq_rewards, batch.group_ids)
        return adv.broadcast_to_tokens(seq_adv, batch.mask), None, {}
    estimator.__name__ = f"_{seq_estimator.__name__}_tokens"
    estimator.__doc__ = seq_estimator.__doc__
    return estimator


def _reinforce_pp(cfg, batch: AdvantageBatch):
    return adv.reinforce_pp_advantages(batch.token_rewards, batch.mask, cfg.gamma), None, {}


def _reinforce_pp_baseline(cfg, batch: AdvantageBatch):
    return adv.reinforce_pp_baseline_advantages(batch.seq_rewards, batch.group_ids, batch.mask), None, {}


def _running_mean(cfg, batch: AdvantageBatch):
    seq_adv, baseline = adv.running_mean_advantages(batch.seq_rewards, batch.baseline, cfg.baseline_momentum)
    return adv.broadcast_to_tokens(seq_adv, batch.mask), None, {"running_baseline": baseline}


_ESTIMATORS: dict[str, Callable] = {
    "gae": _gae, "grpo": _group(adv.grpo_advantages), "drgrpo": _group(adv.drgrpo_advantages),
    "rloo": _group(adv.rloo_advantages), "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline, "running_mean": _running_mean,
}


def _with_recipe_names(base: dict, key: str) -> dict:
    out = dict(base)
    for recipe, preset in PRESETS.items():
        out.setdefault(recipe, base[preset[key]])
    return out


POLICY_LOSSES: dict[str, Callable] = _with_recipe_names(_LOSS_FUNCTIONS, "algorithm.loss")
ADVANTAGE_ESTIMATORS: dict[str, Callable] = _with_recipe_names(_ESTIMATORS, "algorithm.advantage")


def get_policy_loss(name: str) -> Callable:
    """Loss adapter for a loss name, a recipe name or ``'pkg.mod:fn'``."""
    if ":" in name:
        return resolve_import_path(name, "algorithm.loss", want_callable=True)
    if name not in POLICY_LOSSES:
        raise ValueError(f"algorithm.loss: unknown {name!r}; fix: use one of {', '.join(sorted(POLICY_LOSSES))} "
                         "or 'pkg.mod:fn'")
    return POLICY_LOSSES[name]


def get_advantage_estimator(name: str) -> Callable:
    """Estimator for an estimator name, a recipe name or ``'pkg.mod:fn'``."""
    if ":" in name:
        return resolve_import_path(name, "algorithm.advantage", want_callable=True)
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"algorithm.advantage: unknown {name!r}; fix: use one of "
                         f"{', '.join(sorted(ADVANTAGE_ESTIMATORS))}")
    return ADVANTAGE_ESTIMATORS[name]
