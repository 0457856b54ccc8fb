"""`sao doctor`: Check the environment and parallel layouts against a single rank."""
from __future__ import annotations

from ._pending import register_pending


def register(sub) -> None:
    register_pending(sub, "doctor", "Check the environment and parallel layouts against a single rank", 4)
