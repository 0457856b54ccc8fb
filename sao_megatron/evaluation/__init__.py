"""Held-out evaluation: avg@k / pass@k (scores.py) over engines (runner.py)."""
from .scores import pass_at_k, summarize

__all__ = ["pass_at_k", "summarize"]
