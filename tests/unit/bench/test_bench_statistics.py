"""The tests the learning benchmarks' verdicts read (bench/stats.py, bench/survival.py), against values
computed by hand: closed forms of the t distribution, relabelings counted on paper, Holm's steps,
Kaplan-Meier products and a log-rank statistic worked through table by table."""
from __future__ import annotations

import math
import random
import statistics

import pytest

from bench.stats import (compare, fisher_exact, hedges_g, holm, mean_ci, one_sample, permutation, t_cdf, t_ppf,
                         verdict, welch)
from bench.survival import kaplan_meier, logrank, median_survival


# ------------------------------------------------------------------------------ the t distribution

@pytest.mark.parametrize("t, df, cdf", [
    (1.0, 1, 0.75),                                          # Cauchy: 1/2 + atan(1)/pi
    (1.0, 2, 0.5 + 1 / (2 * math.sqrt(3))),                  # df 2: 1/2 + t / (2 sqrt(2 + t^2))
    (-2.0, 2, 0.5 - 2 / (2 * math.sqrt(6))),
    (0.0, 7.3, 0.5),
    (2.0, 4, 0.5 + 0.5 * (2 / math.sqrt(8)) * (1 + 0.5 * 4 / 8)),   # df 4: 1/2 + sin(th)/2 (1 + cos^2(th)/2)
])
def test_the_t_cdf_matches_its_closed_forms(t, df, cdf):
    assert t_cdf(t, df) == pytest.approx(cdf, abs=1e-12)


def test_the_t_quantiles_match_the_printed_tables():
    assert t_ppf(0.975, 5) == pytest.approx(2.5706, abs=1e-4)
    assert t_ppf(0.975, 10) == pytest.approx(2.2281, abs=1e-4)
    assert t_ppf(0.975, 1) == pytest.approx(12.7062, abs=1e-4)      # tan(0.475 pi)


def test_a_mean_interval_is_the_student_t_one():
    # mean 2, sd 1, n 3: 2 +- t(0.975, 2) / sqrt(3), t(0.975, 2) = 4.3027
    ci = mean_ci([1.0, 2.0, 3.0])
    assert ci["mean"] == 2.0 and ci["n"] == 3
    assert ci["hi"] - 2.0 == pytest.approx(4.302653 / math.sqrt(3), abs=1e-5) == pytest.approx(2.0 - ci["lo"])
    assert mean_ci([0.3])["n"] == 1 and math.isnan(mean_ci([0.3])["lo"])
    assert mean_ci([float("nan"), None])["n"] == 0


# ------------------------------------------------------------------------------------------ tests

def test_welch_on_equal_variances_has_an_integer_df_and_the_closed_form_p():
    # means 1 and 3, variances 1 and 1, n 3 each: se^2 = 2/3, t = -2 / sqrt(2/3) = -sqrt(6),
    # df = (2/3)^2 / ((1/3)^2/2 + (1/3)^2/2) = 4; p = 2 F(-sqrt 6; 4) = 1 - 1.2 sqrt(0.6)
    w = welch([0, 1, 2], [2, 3, 4])
    assert w["t"] == pytest.approx(-math.sqrt(6)) and w["df"] == pytest.approx(4.0)
    assert w["p"] == pytest.approx(1 - 1.2 * math.sqrt(0.6), abs=1e-12)


def test_welch_on_unequal_variances_uses_the_satterthwaite_df():
    # a: mean 2, var 1, n 3 (1/3); b: mean 5.5, var 5/3, n 4 (5/12): se^2 = 3/4,
    # df = (3/4)^2 / ((1/3)^2 / 2 + (5/12)^2 / 3) = 0.5625 / (1/18 + 25/432) = 4.9592
    w = welch([1, 2, 3], [4, 5, 6, 7])
    assert w["t"] == pytest.approx(-3.5 / math.sqrt(0.75)) and w["df"] == pytest.approx(0.5625 / (1 / 18 + 25 / 432))


def test_the_exact_permutation_test_counts_relabelings():
    # {1,2,3} vs {4,5,6}: of the C(6,3) = 20 relabelings only the observed one and its mirror reach |diff| = 3
    assert permutation([1, 2, 3], [4, 5, 6]) == {"p": 0.1, "relabelings": 20, "exact": True}
    # {0,0,1} vs {1,1,1}: 4 ones among 6 values; a holds k of them in C(4,k) C(2,3-k) labelings (k=1: 4,
    # k=2: 12, k=3: 4) with diff (2k - 4) / 3. Observed k = 1 (|diff| = 2/3), matched by k = 3: p = 8 / 20
    assert permutation([0, 0, 1], [1, 1, 1])["p"] == pytest.approx(8 / 20)
    big = permutation(list(range(20)), [x + 3 for x in range(20)], draws=20_000)
    assert not big["exact"] and big["relabelings"] == 20_000 and 0 < big["p"] < 1


def test_hedges_g_and_its_interval():
    # d = -2 / 1; J = 1 - 3 / (4*6 - 9) = 0.8; g = -1.6; se = sqrt(6/9 + 2.56/12) = sqrt(0.88)
    g = hedges_g([0, 1, 2], [2, 3, 4])
    assert g["g"] == pytest.approx(-1.6)
    assert g["lo"] == pytest.approx(-1.6 - 1.959964 * math.sqrt(0.88), abs=1e-6)
    assert g["hi"] == pytest.approx(-1.6 + 1.959964 * math.sqrt(0.88), abs=1e-6)


def test_a_gain_against_zero_uses_one_sample_t_and_exact_sign_flips():
    # 5 positive gains: only all-plus and all-minus of the 2^5 sign flips reach the observed |sum|
    test = one_sample([0.1, 0.2, 0.15, 0.12, 0.18])
    assert test["p_perm"] == pytest.approx(2 / 32) and test["perm_relabelings"] == 32
    # mean 0.15, sd sqrt(0.0068 / 4): t = 0.15 / (sd / sqrt 5) = 8.13 on 4 df, p about 0.001
    assert test["t"] == pytest.approx(0.15 / (math.sqrt(0.0017) / math.sqrt(5)))
    assert test["p_welch"] < 0.01 and test["p"] == test["p_perm"]           # the sign-flip test decides


def test_holm_steps_down_and_keeps_the_order():
    # sorted 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1, raised to 0.06)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, float("nan")]) == [1.0, 1.0] and holm([]) == []


def test_a_verdict_needs_the_corrected_p_below_alpha():
    up, down = {"n": 5, "mean": 0.1}, {"n": 5, "mean": -0.1}
    assert verdict(up, 0.01) == "supports" and verdict(down, 0.01) == "refutes"
    assert verdict(up, 0.05) == "cannot tell" and verdict(up, float("nan")) == "cannot tell"
    assert verdict({"n": 0, "mean": 0.1}, 0.0) == "cannot tell"


def _bootstrap_diff_interval(a, b, reps=10_000, seed=0):
    """The percentile bootstrap the report used before (kept here only to show what it said)."""
    rng = random.Random(seed)
    draws = sorted(statistics.fmean(rng.choices(a, k=len(a))) - statistics.fmean(rng.choices(b, k=len(b)))
                   for _ in range(reps))
    return draws[int(0.025 * (reps - 1))], draws[int(0.975 * (reps - 1))]


def test_sao_beats_grpo_was_supported_by_the_bootstrap_and_is_cannot_tell_under_the_corrected_tests():
    # per-seed final accuracy of results/algorithms.json (chain:1:1, 5 seeds each)
    sao = [0.60625, 0.5421875, 0.559375, 0.6296875, 0.553125]
    grpo = [0.5359375, 0.540625, 0.5640625, 0.5234375, 0.546875]
    lo, hi = _bootstrap_diff_interval(sao, grpo)
    assert lo > 0                                    # the bootstrap interval excluded 0: "supports"
    test = compare(sao, grpo)
    assert test["p_welch"] == pytest.approx(0.103, abs=0.001) and test["p_perm"] == pytest.approx(20 / 252)
    assert test["lo"] < 0 < test["hi"]               # the Welch interval spans 0
    assert verdict(test, holm([test["p"]] * 7)[0]) == "cannot tell"
    assert verdict(test, test["p"]) == "cannot tell"  # not even uncorrected


@pytest.mark.parametrize("table, p", [((0, 5, 5, 0), 2 / 252), ((0, 5, 4, 1), 12 / 252), ((1, 4, 4, 1), 52 / 252),
                                      ((2, 3, 2, 3), 1.0)])
def test_fisher_exact_matches_the_hypergeometric_tables(table, p):
    assert fisher_exact(*table) == pytest.approx(p)


# ------------------------------------------------------------------------------------ survival

def test_kaplan_meier_multiplies_the_conditional_survivals():
    # t=2: 5 at risk, 1 event -> 0.8; t=3: 4 at risk (the censored 3 counts), 1 event -> 0.6;
    # t=5: 2 at risk, 1 event -> 0.3; the censored 8 adds no step
    curve = kaplan_meier([2, 3, 3, 5, 8], [True, True, False, True, False])
    assert curve == [(0.0, 1.0), (2.0, pytest.approx(0.8)), (3.0, pytest.approx(0.6)), (5.0, pytest.approx(0.3))]
    assert median_survival(curve) == 5.0
    assert kaplan_meier([4, 9], [False, False]) == [(0.0, 1.0)] and median_survival([(0.0, 1.0)]) is None


def test_logrank_sums_observed_minus_expected_over_event_times():
    # a fails at 1 and 2, b at 3 and 4. t=1: n 4 (a 2), E_a = 1/2, V = 1/4; t=2: n 3 (a 1), E_a = 1/3,
    # V = 2/9; later times have no a at risk. O_a - E_a = 7/6, V = 17/36: chi2 = 49/17
    test = logrank([1, 2], [True, True], [3, 4], [True, True])
    assert test["chi2"] == pytest.approx(49 / 17) and test["observed_a"] == 2
    assert test["expected_a"] == pytest.approx(5 / 6)
    assert test["p"] == pytest.approx(math.erfc(math.sqrt(49 / 34)))
    assert logrank([5, 5], [False, False], [5], [False])["p"] == 1.0     # no event: nothing to test
    same = logrank([1, 2, 3], [True] * 3, [1, 2, 3], [True] * 3)
    assert same["chi2"] == pytest.approx(0.0)
