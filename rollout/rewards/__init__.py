"""Rewards: the RewardFn seam, its resolution from a recipe, and safe application to samples.

A RewardFn takes a finished Sample and returns a float, or a dict with a "reward" float plus extra
info (kept in ``sample.reward_info``). It may be sync (run in a worker thread) or async.
"""
__all__ = ["RewardFn", "apply_reward", "resolve_reward_fn"]


def __getattr__(name: str):
    # Lazy: the sandbox modules in this package are imported by the torch-free sandbox child and by
    # tools without torch; rewards.base needs torch (records.Sample).
    if name in __all__:
        from rollout.rewards import base
        return getattr(base, name)
    raise AttributeError(f"module 'rollout.rewards' has no attribute {name!r}")
