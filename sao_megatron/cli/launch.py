"""`sao launch`: Render and submit a slurm job from a recipe."""
from __future__ import annotations

from ._pending import register_pending


def register(sub) -> None:
    register_pending(sub, "launch", "Render and submit a slurm job from a recipe", 8)
