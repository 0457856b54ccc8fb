"""Markdown for tests over seeds: one table of differences with Welch and permutation p, Hedges' g, the Holm
correction over the table's rows and the verdict it allows (bench/stats.py). Shared by the learning
benchmarks' sections; the claims table (bench/report_claims.py) corrects over its own rows."""
from __future__ import annotations

import math

from bench.report_format import md_table
from bench.stats import ALPHA, ci_text, compare, holm, mean_ci, verdict

INTERVAL_NOTE = ("[lo, hi] = Student-t 95% interval over seeds (the seed is the unit: one number per run); "
                 "differences: Welch 95% interval.")


def seed_ci(row: dict, key: str, scale: float = 1.0) -> dict:
    """A table row's interval recomputed from its per-seed values (the stored one when it has none)."""
    values = row.get("per_seed", {}).get(key)
    ci = mean_ci(values) if values is not None else row.get(key, {"n": 0})
    return {k: (v * scale if k != "n" else v) for k, v in ci.items()}


def differences(pairs: dict[str, tuple[list, list]], digits: int = 3, what: str = "final accuracy") -> str:
    """pairs: {"a - b": (per-seed a, per-seed b)} -> a Markdown table (Holm over these rows)."""
    tests = {name: compare(a, b) for name, (a, b) in pairs.items()}
    if not tests:
        return ""
    corrected = holm([t["p"] for t in tests.values()])
    rows = []
    for (name, t), p in zip(tests.items(), corrected):
        perm = (f"{t['p_perm']:.3f} (exact, {t['perm_relabelings']})" if t["perm_exact"]
                else f"{t['p_perm']:.3f} ({t['perm_relabelings']} random)")
        g = f"{t['g']:.2f} [{t['g_lo']:.2f}, {t['g_hi']:.2f}]" if math.isfinite(t.get("g_lo", math.nan)) else "n/a"
        rows.append([name, f"{t['n_a']} / {t['n_b']}", ci_text(t, digits), _p(t["p_welch"]), perm, g, _p(p),
                     verdict(t, p).replace("supports", "first higher").replace("refutes", "first lower")])
    return md_table([f"difference in {what}", "seeds", "mean [95% CI]", "Welch p", "permutation p",
                     "Hedges' g [95%]", f"p, Holm over {len(rows)}", f"corrected p < {ALPHA}?"], rows)


def _p(p: float) -> str:
    return "n/a" if p is None or math.isnan(p) else f"{p:.3f}"
