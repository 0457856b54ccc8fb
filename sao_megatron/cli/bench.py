"""`sao bench`: Run benchmarks and write results/NAME.json."""
from __future__ import annotations

from ._pending import register_pending


def register(sub) -> None:
    register_pending(sub, "bench", "Run benchmarks and write results/NAME.json", 9)
