"""The SAO paper's claims, one verdict each, from the learning benchmarks' JSON files.

Every row is one test over seeds (bench/stats.py: the seed is the unit): a difference in means tested by
Welch's t and a permutation test (its p is the larger of the two), a gain tested against 0, collapse
counts by Fisher's exact test or times to collapse by a log-rank test. The p-values of EVERY row are
corrected together by Holm's method; a row says "supports" or "refutes" only when its corrected p is
below 0.05, else "cannot tell" (also when the file is missing or from a quick run). The verdicts are
computed here from the per-seed numbers in the JSON, never written by hand.

The paper's figures are quoted with their provenance: only the abstract of arXiv 2607.07508 was
available to this project (/work/shared/notes/algorithms.md), and none of the figures below is
confirmed by it; they come from secondary sources that quote the paper.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

from bench.report_format import md_table, task_order
from bench.stats import ALPHA, compare, fisher_exact, holm, one_sample, test_text, verdict

SECONDARY = "secondary source"
# (claim, the paper's figure it quotes, the algorithms comparison key that tests it)
ALGORITHM_CLAIMS = [
    ("RL improves on the SFT model", f"AIME25: SFT 80.4 -> GRPO 84.2 ({SECONDARY})", "gain:grpo"),
    ("GRPO+DIS beats GRPO", f"AIME25: 84.2 -> 93.5 ({SECONDARY})", "grpo_dis-grpo"),
    ("SAO beats GRPO+DIS", f"AIME25: 93.5 -> 97.3 ({SECONDARY})", "sao-grpo_dis"),
    ("SAO beats GRPO", f"AIME25: 84.2 -> 97.3 ({SECONDARY})", "sao-grpo"),
    ("SAO (DIS) beats PPO-clip with a critic", "no figure: the paper has no PPO arm", "sao-ppo"),
    ("DIS beats PPO-clip inside SAO (same critic, same samples)", "no figure (an ablation of this miniature)",
     "sao-sao_ppo_clip"),
    ("SAO's critic beats a running-mean baseline (single rollout both)", "no figure (an ablation of this "
     "miniature)", "sao-running_mean"),
]
STABLE = ("SAO stays stable where vanilla GRPO collapses",
          f"SAO ~1000 steps stable, GRPO collapses near step 160 ({SECONDARY})")
ONLINE = ("SAO recovers faster than a running-mean baseline after a preference switch",
          f"qualitative, no figure ({SECONDARY})")
UNTESTABLE = ("Not testable here: the benchmark numbers themselves (AIME25, SWE-Bench; a 0.5M-parameter model "
              "on short arithmetic is not a reasoning model), and the critic ablations (K=2 vs 1, frozen "
              "attention), which no benchmark here runs.")
PROVENANCE = ("Provenance of the paper's figures: only the abstract of the SAO paper (arXiv 2607.07508) was "
              "available to this project; the AIME25 chain (SFT 80.4, GRPO 84.2, GRPO+DIS 93.5, SAO 97.3), "
              "'~1000 steps stable' and 'GRPO collapses near step 160' are not in it. They come from secondary "
              "sources that quote the paper (reproductions and cookbooks listed in the project's algorithm "
              "notes) and are marked '" + SECONDARY + "' above. No figure on this page is taken from the "
              "abstract itself.")


def claims_section(results: dict) -> str:
    """Markdown: one row per claim (paper figure, measured, Holm-corrected p, verdict), or '' without data."""
    rows = _algorithm_rows(_usable(results.get("algorithms")))
    stab = _usable(results.get("stability"), key="results")
    if stab and {"sao", "grpo"} <= set(stab["results"]):
        rows.append(_stability_row(stab))
    online = _usable(results.get("online"), key="table")
    if online and {"sao", "running_mean"} <= set(online["table"]):
        rows.append(_online_row(online))
    if not rows:
        return ""
    tested = [r for r in rows if r["p"] is not None]
    corrected = dict(zip(map(id, tested), holm([r["p"] for r in tested])))
    table = [[r["claim"], r["figure"], r["measured"], _p(r["p"]), _p(corrected.get(id(r))),
              _verdict(r, corrected.get(id(r)))] for r in rows]
    return "\n\n".join([
        "**The SAO paper's claims, as this miniature tests them.** The seed is the unit. Each row is one test "
        "(a difference in means: Welch's t-test and a permutation test, p = the larger of the two; a gain "
        "against 0: one-sample t and an exact sign-flip test; collapse: a log-rank test of times to collapse, or "
        f"Fisher's exact test of counts). Holm's correction runs over all {len(tested)} tested rows; supports / refutes "
        f"only when the corrected p < {ALPHA}, else cannot tell. Intervals: Welch / Student-t 95%; g = Hedges' g "
        "with its approximate 95% interval. The sections below give the numbers.",
        md_table(["claim", "the paper's figure", "measured (the first minus the second)", "p", "p, Holm", "verdict"],
                 table), PROVENANCE, UNTESTABLE])


def _usable(result: Optional[dict], key: str = "table") -> Optional[dict]:
    return result if result and not result.get("quick") and key in result else None


def _p(p: float | None) -> str:
    return "n/a" if p is None or math.isnan(p) else f"{p:.3f}"


def _verdict(row: dict, p_corrected: float | None) -> str:
    return verdict({"n": 1, "mean": row["direction"]}, p_corrected)


def per_seed(algos: dict, task: str, algo: str, key: str = "final_acc") -> Optional[list]:
    row = algos["table"].get(f"{task}/{algo}")
    return row["per_seed"][key] if row and "per_seed" in row else None


def _algorithm_rows(algos: Optional[dict]) -> list[dict]:
    if not algos:
        return []
    rows = []
    for task in task_order(algos):
        for claim, figure, key in ALGORITHM_CLAIMS:
            if key.startswith("gain:"):
                gains = per_seed(algos, task, key.split(":")[1], "gain")
                if gains is None:
                    continue
                test = one_sample(gains)
                measured = (f"gain of GRPO's final accuracy over its first batch on `{task}`: {test_text(test)} "
                            f"(permutation = sign flips)")
            else:
                first, second = key.split("-")
                a, b = per_seed(algos, task, first), per_seed(algos, task, second)
                if a is None or b is None:
                    missing = second if a is not None else first
                    arms = algos.get("task_runs", {}).get(task, {}).get("arms", [missing])
                    if algos.get("full") and missing not in arms:
                        continue          # the --full design does not run that arm on this task (FULL_DESIGN)
                    rows.append({"claim": claim, "figure": figure, "p": None, "direction": 0.0,
                                 "measured": f"`{missing}` is not in this file's `{task}` runs: the `--full` "
                                             "design runs it (bench/algorithms.py TASKS_FULL); not yet run at "
                                             "full size"})
                    continue
                test = compare(a, b)
                measured = f"final accuracy {first} - {second} on `{task}`: {test_text(test)}"
            rows.append({"claim": claim, "figure": figure, "measured": measured, "p": test["p"],
                         "direction": test["mean"]})
    return rows


def _stability_row(stab: dict) -> dict:
    """Log-rank test of time to collapse when the file has it; else Fisher's exact test of collapse counts.
    The direction is 'SAO collapses less' (supports) or more (refutes)."""
    sao, grpo = stab["results"]["sao"], stab["results"]["grpo"]
    test = stab.get("logrank", {}).get("sao-grpo")
    if test:
        measured = (f"time to collapse, log-rank SAO vs GRPO: chi2 = {test['chi2']:.2f}; SAO collapsed "
                    f"{test['observed_a']:.0f} (expected {test['expected_a']:.1f} under equal hazards)")
        return {"claim": STABLE[0], "figure": STABLE[1], "measured": measured, "p": test["p"],
                "direction": test["expected_a"] - test["observed_a"]}
    n_sao, n_grpo = len(sao["runs"]), len(grpo["runs"])
    p = fisher_exact(sao["collapsed"], n_sao - sao["collapsed"], grpo["collapsed"], n_grpo - grpo["collapsed"])
    measured = (f"collapsed: SAO {sao['collapsed']} of {n_sao}, GRPO {grpo['collapsed']} of {n_grpo} (Fisher's "
                f"exact test; this file records no time to collapse)")
    return {"claim": STABLE[0], "figure": STABLE[1], "measured": measured, "p": p,
            "direction": grpo["collapsed"] / n_grpo - sao["collapsed"] / n_sao}


def _online_row(online: dict) -> dict:
    """Per-seed reward AUC after the switches when the file has it; else per-seed mean censored recovery steps."""
    table = online["table"]
    if "auc_per_seed" in table["sao"]:
        test = compare(table["sao"]["auc_per_seed"], table["running_mean"]["auc_per_seed"])
        measured = f"reward AUC over every phase after the first, sao - running_mean, per seed: {test_text(test)}"
    else:
        test = compare(recovery_per_seed(table["running_mean"]), recovery_per_seed(table["sao"]))
        measured = ("recovery steps after informative switches (censored at the phase length), mean per seed, "
                    f"running_mean - sao: {test_text(test, 1)}")
    return {"claim": ONLINE[0], "figure": ONLINE[1], "measured": measured, "p": test["p"], "direction": test["mean"]}


def recovery_per_seed(row: dict) -> list[float]:
    """One number per seed: the mean censored recovery over that seed's informative switches."""
    per: dict[int, list[float]] = {}
    for s in row["switches"]:
        if s["informative"]:
            steps = s["recovery_steps"] if s["recovery_steps"] is not None else s["steps_in_phase"]
            per.setdefault(s["seed"], []).append(float(steps))
    return [statistics.fmean(v) for _, v in sorted(per.items())]
