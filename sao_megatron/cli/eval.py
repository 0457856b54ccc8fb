"""`sao eval`: Evaluate a checkpoint (avg@k, pass@k)."""
from __future__ import annotations

from ._pending import register_pending


def register(sub) -> None:
    register_pending(sub, "eval", "Evaluate a checkpoint (avg@k, pass@k)", 8)
