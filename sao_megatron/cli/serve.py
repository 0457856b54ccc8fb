"""`sao serve`: Run the reference rollout server (SGLang HTTP protocol, CPU)."""
from __future__ import annotations

from ._pending import register_pending


def register(sub) -> None:
    register_pending(sub, "serve", "Run the reference rollout server (SGLang HTTP protocol, CPU)", 5)
