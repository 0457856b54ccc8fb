"""Where the run is: the trainer's own record, saved and loaded by every checkpoint as `trainer`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TrainerState:
    """The loop advances it once per iteration; a resume continues from the saved one.

    `step` counts iterations (critic warm-up included), `version` is the weight version the engines
    serve (one per policy update), `baseline` the running-mean reward baseline (advantage
    'running_mean'; None until the first batch), `lr_steps` the learning-rate schedule's position per
    trained model ("policy", "critic": optimizer steps taken; parallel/optimizer.py LrSchedule), so a resume
    continues the schedule (checkpoints from before it existed resume at 0).
    """

    step: int = 0
    version: int = 0
    baseline: Optional[float] = None
    lr_steps: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        return {"step": self.step, "version": self.version, "baseline": self.baseline,
                "lr_steps": dict(self.lr_steps)}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.version = int(state["step"]), int(state["version"])
        self.baseline = state.get("baseline")
        self.lr_steps = {k: int(v) for k, v in state.get("lr_steps", {}).items()}


def total_steps(recipe) -> int:
    """Iterations of a run: the critic warm-up (critic updates only) and then run.num_steps policy steps."""
    return warmup_steps(recipe) + recipe.run.num_steps


def warmup_steps(recipe) -> int:
    return recipe.critic.warmup_steps if recipe.critic.enabled else 0
