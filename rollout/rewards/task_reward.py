"""The reward of the built-in tasks, dispatched on ``sample.metadata["task"]``."""
from __future__ import annotations

from rollout.rewards.environments import ChangingEnvironment
from rollout.rewards.tasks import get_task
from sao_megatron.core.records import Sample


def task_reward(sample: Sample) -> dict:
    """Score the response with its task's checker; the online task scores at ``metadata["env_step"]``.

    ``correct`` (1.0 or 0.0) says whether the answer is exactly right: the rollout/accuracy metric.
    An agent episode's submitted answer (``metadata["submitted"]``) is scored instead of the text.
    """
    text = sample.metadata.get("submitted", sample.response_text)
    task = sample.metadata.get("task")
    if task is None:
        raise ValueError(f"sample {sample.uid} has no metadata['task']; set rollout.reward_fn for dataset prompts")
    if task == "online":
        env = ChangingEnvironment.from_metadata(sample.metadata)
        step = int(sample.metadata.get("env_step", 0))
        return {"reward": env.score(text, sample.label, step), "env_phase": env.phase(step)}
    checker = get_task(task)
    return {"reward": checker.score(text, sample.label), "correct": float(checker.is_exact(text, sample.label))}
