"""`sao plan`: Plan memory per GPU and layouts for a recipe."""
from __future__ import annotations

from ._pending import register_pending


def register(sub) -> None:
    register_pending(sub, "plan", "Plan memory per GPU and layouts for a recipe", 8)
