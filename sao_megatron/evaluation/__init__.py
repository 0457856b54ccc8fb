"""Held-out evaluation: avg@k / pass@k (scores.py) over engines (runner.py); agentic benchmarks plug in
as an `AgenticEval` (runner.py), e.g. the SWE-bench-style code repair set (code_repair.py)."""
from .scores import pass_at_k, summarize

__all__ = ["pass_at_k", "summarize"]
