"""Intervals over seeds for the learning benchmarks: percentile bootstrap of a mean and of a difference
of means, and the verdict a difference supports.

With 5 seeds a percentile bootstrap is narrower than the true 95% interval (it cannot see variation
the 5 seeds did not show); the report says so next to every interval. Deterministic: a fixed seed.
"""
from __future__ import annotations

import math
import random
import statistics

REPS = 10_000
LEVEL = 0.95


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def _percentiles(draws: list[float], level: float) -> tuple[float, float]:
    draws = sorted(draws)
    lo = draws[int((1 - level) / 2 * (len(draws) - 1))]
    hi = draws[int((1 + level) / 2 * (len(draws) - 1))]
    return lo, hi


def mean_ci(values, reps: int = REPS, level: float = LEVEL, seed: int = 0) -> dict:
    """{"mean", "lo", "hi", "n"}: the mean and its percentile-bootstrap interval (NaN when empty)."""
    xs = _finite(values)
    if not xs:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0}
    rng = random.Random(seed)
    draws = [statistics.fmean(rng.choices(xs, k=len(xs))) for _ in range(reps)]
    lo, hi = _percentiles(draws, level)
    return {"mean": statistics.fmean(xs), "lo": lo, "hi": hi, "n": len(xs)}


def diff_ci(a, b, reps: int = REPS, level: float = LEVEL, seed: int = 0) -> dict:
    """mean(a) - mean(b) with a bootstrap interval resampling each group on its own (unpaired)."""
    xa, xb = _finite(a), _finite(b)
    if not xa or not xb:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": min(len(xa), len(xb))}
    rng = random.Random(seed)
    draws = [statistics.fmean(rng.choices(xa, k=len(xa))) - statistics.fmean(rng.choices(xb, k=len(xb)))
             for _ in range(reps)]
    lo, hi = _percentiles(draws, level)
    return {"mean": statistics.fmean(xa) - statistics.fmean(xb), "lo": lo, "hi": hi, "n": min(len(xa), len(xb))}


def verdict(diff: dict) -> str:
    """What a difference's interval says about 'the first is higher': supports / refutes / cannot tell."""
    if not diff["n"] or math.isnan(diff["lo"]):
        return "cannot tell"
    if diff["lo"] > 0:
        return "supports"
    if diff["hi"] < 0:
        return "refutes"
    return "cannot tell"


def ci_text(ci: dict, digits: int = 3) -> str:
    """'0.512 [0.480, 0.540]'"""
    if not ci.get("n"):
        return "n/a"
    return f"{ci['mean']:.{digits}f} [{ci['lo']:.{digits}f}, {ci['hi']:.{digits}f}]"


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p of Fisher's exact test on the 2x2 table [[a, b], [c, d]] (rows: groups; columns:
    event, no event): the probability, with the margins fixed, of a table no more likely than this one."""
    from math import comb

    rows, col, n = a + b, a + c, a + b + c + d

    def prob(x: int) -> float:
        return comb(rows, x) * comb(n - rows, col - x) / comb(n, col)

    observed = prob(a)
    lo, hi = max(0, col - (n - rows)), min(rows, col)
    return min(1.0, sum(prob(x) for x in range(lo, hi + 1) if prob(x) <= observed * (1 + 1e-9)))
