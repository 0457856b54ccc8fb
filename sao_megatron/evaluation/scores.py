"""avg@k and pass@k from per-problem sample correctness.

avg@k (the SAO paper's "avg@16"): mean correctness over k samples per problem, averaged over problems.
pass@k: the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374, eq. 1) from n >= k samples with
c correct: pass@k = 1 - C(n - c, k) / C(n, k), averaged over problems.
"""
from __future__ import annotations

from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize(correct: list[list[float]], ks: list[int]) -> dict[str, float]:
    """correct[p][j] in [0, 1] is sample j of problem p (a partial score counts as correct when >= 1)."""
    if not correct:
        return {}
    n = min(len(row) for row in correct)
    out = {f"avg@{n}": sum(sum(row[:n]) / n for row in correct) / len(correct)}
    for k in ks:
        if 1 <= k <= n:
            out[f"pass@{k}"] = sum(pass_at_k(n, sum(1 for x in row[:n] if x >= 1.0), k) for row in correct) / len(correct)
    out["problems"] = float(len(correct))
    return out
