"""The rollout/* numbers of one batch of finished samples, computed here only.

The trainer logs them for the batch a step trained on (trainer/steps.py `rollout_metrics`); a sample
source reports them for the last batch it handed out (RolloutDriver.metrics, SavedRollouts.metrics),
so a run without the trainer (bench/pipeline.py) sees the same names and values.

    rollout/raw_reward, _std    mean and (unbiased) standard deviation of the samples' rewards
    rollout/accuracy            share of exactly correct answers (sao_megatron/metrics/learning.py)
    rollout/response_len, _max  response tokens per sample
    rollout/turns               model turns per sample (1 without an agent loop)
    rollout/staleness, _max     trainer version minus the oldest weight version of a sample's tokens
    rollout/truncated_frac      share of samples cut off at max_new_tokens
"""
from __future__ import annotations

import torch

from sao_megatron.core.records import Sample, SampleStatus
from sao_megatron.metrics.learning import accuracy

KEYS = ("rollout/raw_reward", "rollout/raw_reward_std", "rollout/accuracy", "rollout/response_len",
        "rollout/response_len_max", "rollout/turns", "rollout/staleness", "rollout/staleness_max",
        "rollout/truncated_frac")


def batch_metrics(samples: list[Sample], version: int) -> dict:
    """rollout/* numbers of `samples` for a trainer whose policy is `version`; zeros for no samples
    (a source asked before its first batch)."""
    if not samples:
        return dict.fromkeys(KEYS, 0.0)
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples])
    lengths = torch.tensor([float(len(s.response_ids)) for s in samples])
    stale = torch.tensor([float(s.staleness(version)) for s in samples])
    return {
        "rollout/raw_reward": rewards.mean().item(),
        "rollout/raw_reward_std": rewards.std().item() if len(samples) > 1 else 0.0,
        "rollout/accuracy": accuracy(samples),
        "rollout/response_len": lengths.mean().item(),
        "rollout/response_len_max": lengths.max().item(),
        "rollout/turns": sum(s.metadata.get("turns", 1) for s in samples) / len(samples),
        "rollout/staleness": stale.mean().item(),
        "rollout/staleness_max": stale.max().item(),
        "rollout/truncated_frac": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
    }
