"""Algorithm presets: the hyper-parameters each named algorithm implies.

A preset only fills fields the recipe leaves unset; anything written in the recipe or on the command
line wins. Values and sources are in docs/algorithms.md.
"""
from __future__ import annotations

_GROUP = {"rollout.mode": "group", "critic.enabled": False}

PRESETS: dict[str, dict] = {
    # SAO (arXiv 2607.07508): single rollout, value model, DIS band of the reasoning recipe.
    "sao": {"algorithm.loss": "dis", "algorithm.advantage": "gae", "algorithm.eps_low": 0.3,
            "algorithm.eps_high": 5.0, "rollout.mode": "single", "critic.enabled": True},
    "ppo": {"algorithm.loss": "ppo", "algorithm.advantage": "gae", "algorithm.eps_low": 0.2,
            "algorithm.eps_high": 0.2, "algorithm.lambda_actor": 0.95, "rollout.mode": "single",
            "critic.enabled": True, "critic.freeze_attention": False},
    "grpo": {"algorithm.loss": "ppo", "algorithm.advantage": "grpo", "algorithm.eps_low": 0.2,
             "algorithm.eps_high": 0.2, **_GROUP},
    "grpo_dis": {"algorithm.loss": "dis", "algorithm.advantage": "grpo", "algorithm.eps_low": 0.3,
                 "algorithm.eps_high": 5.0, **_GROUP},
    # GSPO (arXiv 2507.18071): sequence ratio, tiny clip range, 4 mini-batches per rollout batch.
    "gspo": {"algorithm.loss": "gspo", "algorithm.advantage": "grpo", "algorithm.eps_low": 3e-4,
             "algorithm.eps_high": 4e-4, "algorithm.mini_batches": 4,
             "algorithm.loss_agg": "seq-mean-token-mean", **_GROUP},
    "gspo_token": {"algorithm.loss": "gspo_token", "algorithm.advantage": "grpo", "algorithm.eps_low": 3e-4,
                   "algorithm.eps_high": 4e-4, "algorithm.mini_batches": 4,
                   "algorithm.loss_agg": "seq-mean-token-mean", **_GROUP},
    # DAPO: clip-higher, dynamic sampling, token-level loss.
    "dapo": {"algorithm.loss": "ppo", "algorithm.advantage": "grpo", "algorithm.eps_low": 0.2,
             "algorithm.eps_high": 0.28, "algorithm.dynamic_sampling": True,
             "algorithm.loss_agg": "token-mean", **_GROUP},
    "drgrpo": {"algorithm.loss": "ppo", "algorithm.advantage": "drgrpo", "algorithm.eps_low": 0.2,
               "algorithm.eps_high": 0.2, "algorithm.loss_agg": "seq-mean-token-sum-norm", **_GROUP},
    "rloo": {"algorithm.loss": "ppo", "algorithm.advantage": "rloo", "algorithm.eps_low": 0.2,
             "algorithm.eps_high": 0.2, **_GROUP},
    "reinforce_pp": {"algorithm.loss": "ppo", "algorithm.advantage": "reinforce_pp", "algorithm.eps_low": 0.2,
                     "algorithm.eps_high": 0.2, "critic.enabled": False},
    # REINFORCE with a running-mean baseline: the online-learning comparison of the SAO paper.
    "running_mean": {"algorithm.loss": "ppo", "algorithm.advantage": "running_mean", "algorithm.eps_low": 0.2,
                     "algorithm.eps_high": 0.2, "rollout.mode": "single", "critic.enabled": False},
}

GROUP_ADVANTAGES = ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline")
LOSSES = ("dis", "ppo", "gspo", "gspo_token", "cispo")
ADVANTAGES = ("gae",) + GROUP_ADVANTAGES + ("reinforce_pp", "running_mean")
