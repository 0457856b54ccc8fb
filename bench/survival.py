"""Time to collapse over seeds: Kaplan-Meier curves and the log-rank test (bench/stability.py).

A run is one subject: its time is the policy step at which it collapsed (event) or its last step (censored:
it had not collapsed when the run ended). Censored runs count as at risk up to and including their time,
so at a tie an event is counted before a censoring, as is usual.
"""
from __future__ import annotations

import math


def kaplan_meier(times: list[float], events: list[bool]) -> list[tuple[float, float]]:
    """[(time, S(time))] starting at (0, 1.0), one point per distinct event time:
    S(t) = prod over event times t_i <= t of (1 - d_i / n_i), d_i events at t_i, n_i at risk just before it."""
    curve, survival = [(0.0, 1.0)], 1.0
    for t in sorted({t for t, e in zip(times, events) if e}):
        at_risk = sum(1 for x in times if x >= t)
        died = sum(1 for x, e in zip(times, events) if e and x == t)
        survival *= 1.0 - died / at_risk
        curve.append((float(t), survival))
    return curve


def median_survival(curve: list[tuple[float, float]]) -> float | None:
    """The first time S(t) <= 0.5; None when the curve never gets there (most runs never collapsed)."""
    return next((t for t, s in curve if s <= 0.5), None)


def logrank(times_a: list[float], events_a: list[bool], times_b: list[float], events_b: list[bool]) -> dict:
    """Two-sided log-rank test of equal hazards: {"chi2", "p", "observed_a", "expected_a"}.

    At each distinct event time t: n at risk (n_a in group a), d events (d_a in a); E_a += d n_a / n,
    V += d (n_a / n)(1 - n_a / n)(n - d) / (n - 1). chi2 = (O_a - E_a)^2 / V on 1 degree of freedom,
    p = erfc(sqrt(chi2 / 2)). No event at all: p = 1."""
    event_times = sorted({t for t, e in zip(times_a + times_b, events_a + events_b) if e})
    observed = expected = variance = 0.0
    for t in event_times:
        n_a = sum(1 for x in times_a if x >= t)
        n = n_a + sum(1 for x in times_b if x >= t)
        d_a = sum(1 for x, e in zip(times_a, events_a) if e and x == t)
        d = d_a + sum(1 for x, e in zip(times_b, events_b) if e and x == t)
        observed += d_a
        expected += d * n_a / n
        if n > 1:
            variance += d * (n_a / n) * (1 - n_a / n) * (n - d) / (n - 1)
    if variance <= 0:
        return {"chi2": 0.0, "p": 1.0, "observed_a": observed, "expected_a": expected}
    chi2 = (observed - expected) ** 2 / variance
    return {"chi2": chi2, "p": math.erfc(math.sqrt(chi2 / 2)), "observed_a": observed, "expected_a": expected}


def plot_survival(curves: dict[str, list[tuple[float, float]]], path, title: str) -> None:
    """Step plot of each method's Kaplan-Meier curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, curve in curves.items():
        ax.step([t for t, _ in curve], [s for _, s in curve], where="post", label=label)
    ax.set_xlabel("policy step")
    ax.set_ylabel("share of runs not collapsed")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
