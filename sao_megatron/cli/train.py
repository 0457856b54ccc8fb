"""`sao train`: Train a policy with SAO or a baseline from a recipe."""
from __future__ import annotations

from ._pending import register_pending


def register(sub) -> None:
    register_pending(sub, "train", "Train a policy with SAO or a baseline from a recipe", 8)
