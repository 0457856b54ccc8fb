"""Tests over seeds for the learning benchmarks: the seed is the unit, one number per run.

- mean_ci: the mean over seeds with its Student-t 95% interval;
- compare(a, b): mean(a) - mean(b) with its Welch 95% interval, Welch's t-test, a permutation test of the
  difference in means (exact over every relabeling up to MAX_EXACT of them, else PERM_DRAWS random ones,
  the count stated in the result) and Hedges' g with an approximate 95% interval;
- one_sample(xs): the same for "the mean of xs is not 0" (a paired gain): one-sample t and an exact sign-flip test;
- holm: Holm's step-down correction over a family of p-values;
- verdict: "supports" / "refutes" only when the corrected p < ALPHA, else "cannot tell".

A comparison's p is the larger of its t-test and permutation p (a verdict must survive both: the t-test
assumes normal means, the permutation test assumes only exchangeable seeds). No scipy: the t
distribution's CDF is the regularized incomplete beta function, evaluated by its continued fraction.
"""
from __future__ import annotations

import itertools
import math
import statistics

LEVEL = 0.95
ALPHA = 0.05
MAX_EXACT = 10**6        # relabelings enumerated exactly; above this, Monte-Carlo
PERM_DRAWS = 200_000     # Monte-Carlo relabelings (p = (1 + hits) / (1 + draws))
Z95 = 1.959963984540054


def finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


# ------------------------------------------------------------------------------- the t distribution


def _beta_cf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):          # the fraction converges fast on this side
        return math.exp(log_front) * _beta_cf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_cf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom (df may be fractional, as Welch's is)."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(q: float, df: float) -> float:
    """The q-quantile of Student's t (bisection on t_cdf)."""
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


# ----------------------------------------------------------------------------------------- tests


def mean_ci(values, level: float = LEVEL) -> dict:
    """{"mean", "lo", "hi", "n"}: the mean over seeds and its Student-t interval (NaN when empty)."""
    xs = finite(values)
    if not xs:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0}
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": mean, "lo": float("nan"), "hi": float("nan"), "n": 1}
    half = t_ppf((1 + level) / 2, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": len(xs)}


def welch(a, b) -> dict:
    """Welch's t-test of mean(a) = mean(b): {"t", "df", "p"} (two-sided), p NaN with fewer than 2 per group."""
    xa, xb = finite(a), finite(b)
    if len(xa) < 2 or len(xb) < 2:
        return {"t": float("nan"), "df": float("nan"), "p": float("nan"), "se": float("nan")}
    va, vb = statistics.variance(xa) / len(xa), statistics.variance(xb) / len(xb)
    diff = statistics.fmean(xa) - statistics.fmean(xb)
    if va + vb == 0:                            # no spread at all: any difference is certain
        return {"t": math.copysign(math.inf, diff) if diff else 0.0, "df": float(len(xa) + len(xb) - 2),
                "p": 0.0 if diff else 1.0, "se": 0.0}
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(xa) - 1) + vb**2 / (len(xb) - 1))
    t = diff / se
    return {"t": t, "df": df, "p": min(1.0, 2 * t_cdf(-abs(t), df)), "se": se}


def permutation(a, b, max_exact: int = MAX_EXACT, draws: int = PERM_DRAWS, seed: int = 0) -> dict:
    """Two-sided permutation test of the difference in means: the share of relabelings of the pooled
    seeds whose |mean(a') - mean(b')| is at least the observed one. {"p", "relabelings", "exact"}."""
    xa, xb = finite(a), finite(b)
    if not xa or not xb:
        return {"p": float("nan"), "relabelings": 0, "exact": True}
    pooled, na, nb = xa + xb, len(xa), len(xb)
    total = sum(pooled)
    observed = abs(sum(xa) / na - sum(xb) / nb) - 1e-12 * (1 + abs(total))   # ties count as extreme
    count = math.comb(na + nb, na)
    if count <= max_exact:
        hits = sum(1 for idx in itertools.combinations(range(na + nb), na)
                   if abs((s := sum(pooled[i] for i in idx)) / na - (total - s) / nb) >= observed)
        return {"p": hits / count, "relabelings": count, "exact": True}
    import numpy as np

    rng, values, hits = np.random.default_rng(seed), np.asarray(pooled), 0
    for start in range(0, draws, 10_000):
        keys = rng.random((min(10_000, draws - start), na + nb))
        sums = values[np.argsort(keys, axis=1)[:, :na]].sum(axis=1)
        hits += int((np.abs(sums / na - (total - sums) / nb) >= observed).sum())
    return {"p": (1 + hits) / (1 + draws), "relabelings": draws, "exact": False}


def hedges_g(a, b) -> dict:
    """Hedges' g (Cohen's d on the pooled SD, times J = 1 - 3/(4(na+nb) - 9)) with the normal-approximation
    95% interval g +- 1.96 sqrt((na+nb)/(na nb) + g^2 / (2(na+nb))) (Hedges & Olkin 1985)."""
    xa, xb = finite(a), finite(b)
    na, nb = len(xa), len(xb)
    if na < 2 or nb < 2:
        return {"g": float("nan"), "lo": float("nan"), "hi": float("nan")}
    pooled = math.sqrt(((na - 1) * statistics.variance(xa) + (nb - 1) * statistics.variance(xb)) / (na + nb - 2))
    diff = statistics.fmean(xa) - statistics.fmean(xb)
    if pooled == 0:
        g = math.copysign(math.inf, diff) if diff else 0.0
        return {"g": g, "lo": g, "hi": g}
    g = (1 - 3 / (4 * (na + nb) - 9)) * diff / pooled
    se = math.sqrt((na + nb) / (na * nb) + g * g / (2 * (na + nb)))
    return {"g": g, "lo": g - Z95 * se, "hi": g + Z95 * se}


def compare(a, b, level: float = LEVEL) -> dict:
    """mean(a) - mean(b) over seeds: Welch interval, Welch and permutation p, Hedges' g; "p" = the larger p."""
    xa, xb = finite(a), finite(b)
    w, perm, g = welch(xa, xb), permutation(xa, xb), hedges_g(xa, xb)
    diff = statistics.fmean(xa) - statistics.fmean(xb) if xa and xb else float("nan")
    half = t_ppf((1 + level) / 2, w["df"]) * w["se"] if math.isfinite(w["df"]) and w["se"] > 0 else \
        (0.0 if w["se"] == 0 else float("nan"))
    return {"mean": diff, "lo": diff - half, "hi": diff + half, "n": min(len(xa), len(xb)), "n_a": len(xa),
            "n_b": len(xb), "t": w["t"], "df": w["df"], "p_welch": w["p"], "p_perm": perm["p"],
            "perm_relabelings": perm["relabelings"], "perm_exact": perm["exact"],
            "p": max(w["p"], perm["p"]) if not (math.isnan(w["p"]) or math.isnan(perm["p"])) else float("nan"),
            "g": g["g"], "g_lo": g["lo"], "g_hi": g["hi"]}


def one_sample(values, level: float = LEVEL, max_exact: int = MAX_EXACT) -> dict:
    """mean(xs) against 0 (e.g. paired gains): t interval, one-sample t p and an exact sign-flip p
    (Monte-Carlo sign flips beyond max_exact), and the standardized mean mean/sd; "p" = the larger p."""
    xs = finite(values)
    ci = mean_ci(xs, level)
    if len(xs) < 2:
        return {**ci, "p_welch": float("nan"), "p_perm": float("nan"), "p": float("nan"), "g": float("nan"),
                "perm_relabelings": 0, "perm_exact": True}
    sd, mean = statistics.stdev(xs), ci["mean"]
    t = mean / (sd / math.sqrt(len(xs))) if sd else (math.copysign(math.inf, mean) if mean else 0.0)
    p_t = min(1.0, 2 * t_cdf(-abs(t), len(xs) - 1)) if t else 1.0
    observed = abs(sum(xs)) - 1e-12 * (1 + sum(abs(x) for x in xs))
    if 2 ** len(xs) <= max_exact:
        flips = list(itertools.product((1, -1), repeat=len(xs)))
        p_perm, exact = sum(abs(sum(s * x for s, x in zip(f, xs))) >= observed for f in flips) / len(flips), True
    else:
        import random

        rng = random.Random(0)
        hits = sum(abs(sum(x if rng.random() < 0.5 else -x for x in xs)) >= observed for _ in range(PERM_DRAWS))
        p_perm, exact = (1 + hits) / (1 + PERM_DRAWS), False
    return {**ci, "t": t, "df": len(xs) - 1, "p_welch": p_t, "p_perm": p_perm, "p": max(p_t, p_perm),
            "perm_relabelings": 2 ** len(xs) if exact else PERM_DRAWS, "perm_exact": exact,
            "g": mean / sd if sd else float("nan")}


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: the i-th smallest p times (m - i + 1),
    made non-decreasing and capped at 1. A NaN p (an untested comparison) counts in m as 1.0."""
    ps = [1.0 if p is None or math.isnan(p) else float(p) for p in pvalues]
    m, out, running = len(ps), [0.0] * len(ps), 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: ps[i])):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        out[i] = running
    return out


def verdict(diff: dict, p_corrected: float, alpha: float = ALPHA) -> str:
    """'supports' (the first is higher) / 'refutes' only when the corrected p < alpha; else 'cannot tell'."""
    if not diff.get("n") or p_corrected is None or math.isnan(p_corrected) or p_corrected >= alpha:
        return "cannot tell"
    return "supports" if diff["mean"] > 0 else "refutes"


def ci_text(ci: dict, digits: int = 3) -> str:
    """'0.512 [0.480, 0.540]'"""
    if not ci.get("n"):
        return "n/a"
    if math.isnan(ci.get("lo", float("nan"))):
        return f"{ci['mean']:.{digits}f}"
    return f"{ci['mean']:.{digits}f} [{ci['lo']:.{digits}f}, {ci['hi']:.{digits}f}]"


def test_text(c: dict, digits: int = 3) -> str:
    """'0.036 [-0.01, 0.08], Welch p = 0.10, permutation p = 0.13 (exact, 252), g = 1.1 [-0.2, 2.4]'"""
    if not c.get("n"):
        return "not measured"
    perm = f"exact over {c['perm_relabelings']}" if c.get("perm_exact") else f"{c['perm_relabelings']} random relabelings"
    g = (f", g = {c['g']:.2f} [{c['g_lo']:.2f}, {c['g_hi']:.2f}]" if "g_lo" in c and math.isfinite(c["g_lo"])
         else "")
    return f"{ci_text(c, digits)}, Welch p = {c['p_welch']:.3f}, permutation p = {c['p_perm']:.3f} ({perm}){g}"


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p of Fisher's exact test on the 2x2 table [[a, b], [c, d]] (rows: groups; columns:
    event, no event): the probability, with the margins fixed, of a table no more likely than this one."""
    rows, col, n = a + b, a + c, a + b + c + d

    def prob(x: int) -> float:
        return math.comb(rows, x) * math.comb(n - rows, col - x) / math.comb(n, col)

    observed = prob(a)
    lo, hi = max(0, col - (n - rows)), min(rows, col)
    return min(1.0, sum(prob(x) for x in range(lo, hi + 1) if prob(x) <= observed * (1 + 1e-9)))
