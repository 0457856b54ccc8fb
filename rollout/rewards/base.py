"""The RewardFn seam: resolve one from a recipe, apply it with a timeout, never stop the run.

A reward that raises, returns something that is not a finite number, or runs past
``rollout.reward_timeout_s`` marks the sample FAILED with the reason in ``metadata["error"]``;
the driver counts it (rollout/failed) and keeps going. A sync reward that times out keeps running
in its worker thread (Python cannot kill a thread); only its result is ignored, so rewards that may
hang should be async or use the sandbox, which kills its subprocess.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import math
from concurrent.futures import Executor
from typing import Any, Awaitable, Callable, Optional, Union

from sao_megatron.core.imports import resolve_import_path
from sao_megatron.core.records import Sample, SampleStatus

log = logging.getLogger(__name__)

RewardOut = Union[float, int, dict]
RewardFn = Callable[[Sample], Union[RewardOut, Awaitable[RewardOut]]]


def resolve_reward_fn(cfg) -> RewardFn:
    """The recipe's reward: ``cfg.reward_fn`` import path, else math-verify for a dataset, else the task's.

    An imported object with a ``from_config(cfg)`` classmethod (e.g. the HTTP reward model) is built
    from the rollout config; any other callable is used as is.
    """
    if cfg.reward_fn:
        obj = resolve_import_path(cfg.reward_fn, "rollout.reward_fn")
        if hasattr(obj, "from_config"):
            obj = obj.from_config(cfg)
        if not callable(obj):
            raise ValueError(f"rollout.reward_fn: {cfg.reward_fn!r} is not callable; point it at a function")
        return obj
    if cfg.dataset:             # a dataset wins over the task, as in build_prompt_source
        from rollout.rewards.math import math_reward
        return math_reward
    from rollout.rewards.task_reward import task_reward
    return task_reward


def _is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _normalise(out: Any) -> tuple[float, dict]:
    info: dict = {}
    if isinstance(out, dict):
        if "reward" not in out:
            raise ValueError(f"reward dict has no 'reward' key (keys: {sorted(out)})")
        info = {k: v for k, v in out.items() if k != "reward"}
        out = out["reward"]
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        raise ValueError(f"reward is {type(out).__name__}, expected a float")
    value = float(out)
    if not math.isfinite(value):
        raise ValueError(f"reward is {value}, expected a finite float")
    return value, info


async def apply_reward(fn: RewardFn, sample: Sample, timeout_s: float,
                       executor: Optional[Executor] = None) -> bool:
    """Set ``sample.reward`` (and reward_info); on failure mark it FAILED. Returns success."""
    try:
        if _is_async(fn):
            out = await asyncio.wait_for(fn(sample), timeout_s)
        else:
            loop = asyncio.get_running_loop()
            out = await asyncio.wait_for(loop.run_in_executor(executor, fn, sample), timeout_s)
        sample.reward, sample.reward_info = _normalise(out)
        return True
    except asyncio.TimeoutError:
        reason = f"reward timed out after {timeout_s}s (rollout.reward_timeout_s)"
    except Exception as exc:  # a user reward's bug fails this sample only, with the reason recorded
        reason = f"reward raised {type(exc).__name__}: {exc}"
    sample.status = SampleStatus.FAILED
    sample.reward = None
    sample.metadata["error"] = reason
    log.warning("sample %s failed: %s", sample.uid, reason)
    return False
