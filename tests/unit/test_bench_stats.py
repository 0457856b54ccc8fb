"""The intervals and tests the learning benchmarks' verdicts read (bench/stats.py), against values
computed by hand or by a textbook."""
from __future__ import annotations

import math

import pytest

from bench.stats import ci_text, diff_ci, fisher_exact, mean_ci, verdict


def test_a_bootstrap_interval_holds_the_mean_inside_the_sample_range_and_is_reproducible():
    xs = [0.5, 0.6, 0.7, 0.55, 0.65]
    ci = mean_ci(xs)
    assert ci["mean"] == pytest.approx(0.6) and min(xs) <= ci["lo"] < 0.6 < ci["hi"] <= max(xs) and ci["n"] == 5
    assert mean_ci(xs) == ci                                   # a fixed seed: the report does not move
    assert mean_ci([0.3] * 5) == {"mean": 0.3, "lo": 0.3, "hi": 0.3, "n": 5}
    assert mean_ci([float("nan"), None])["n"] == 0 and math.isnan(mean_ci([])["mean"])


def test_a_difference_is_supported_refuted_or_undecided_by_where_its_interval_lies():
    assert verdict(diff_ci([0.8, 0.9, 0.85], [0.2, 0.3, 0.25])) == "supports"
    assert verdict(diff_ci([0.2, 0.3, 0.25], [0.8, 0.9, 0.85])) == "refutes"
    assert verdict(diff_ci([0.2, 0.9, 0.5], [0.3, 0.8, 0.6])) == "cannot tell"
    assert verdict(diff_ci([], [0.1])) == "cannot tell"
    assert ci_text({"mean": 0.5, "lo": 0.25, "hi": 0.75, "n": 3}) == "0.500 [0.250, 0.750]"


# two-sided p: the sum of the hypergeometric tables (out of C(10, 5) = 252) no more likely than the observed one
@pytest.mark.parametrize("table, p", [((0, 5, 5, 0), 2 / 252), ((0, 5, 4, 1), 12 / 252), ((1, 4, 4, 1), 52 / 252),
                                      ((2, 3, 2, 3), 1.0)])
def test_fisher_exact_matches_the_hypergeometric_tables(table, p):
    assert fisher_exact(*table) == pytest.approx(p)
