"""Rewards: the RewardFn seam, its resolution from a recipe, and safe application to samples.

A RewardFn takes a finished Sample and returns a float, or a dict with a "reward" float plus extra
info (kept in ``sample.reward_info``). It may be sync (run in a worker thread) or async.
"""
from rollout.rewards.base import RewardFn, apply_reward, resolve_reward_fn

__all__ = ["RewardFn", "apply_reward", "resolve_reward_fn"]
