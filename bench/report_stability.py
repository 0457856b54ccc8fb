"""Report section of `sao bench stability`: did each run first learn (peak_gain, learned), did it collapse
and when (Kaplan-Meier, log-rank against SAO), final accuracy over seeds. Everything is recomputed from
the per-run numbers in stability.json; files older than a field say so instead of guessing it."""
from __future__ import annotations

import statistics

from bench.report_format import md_table
from bench.report_tests import INTERVAL_NOTE, differences, seed_ci
from bench.stats import holm
from bench.survival import kaplan_meier, logrank, median_survival

NOT_RUN = "not yet run at full size"


def peak_gain(run: dict) -> float:
    """The run's recorded peak_gain; in older files, peak accuracy (any moving-average window) minus the
    first batch, which a one-batch start and short early windows make noisier (the report says so)."""
    return run.get("peak_gain", run["peak_acc"] - run["start_acc"])


def _peak_gain_text(runs: list[dict]) -> str:
    if runs and "peak_gain" in runs[0]:
        return ("Peak gain = the peak of the full-window moving averages of accuracy minus the mean of the run's "
                "first 10 batches (the SFT model's own samples).")
    return ("Peak gain (this file predates the recorded one): peak accuracy over any moving-average window minus "
            "the run's first batch; a one-batch start and the short early windows make it noisy, biased upward.")


def collapse_times(runs: list[dict]) -> tuple[list[float], list[bool]] | None:
    """(time, collapsed) per run for survival analysis; None when the file records no collapse step."""
    if not runs or any("collapse_step" not in x for x in runs):
        return None
    return ([float(x["collapse_step"] if x["collapse_step"] is not None else x["steps"]) for x in runs],
            [x["collapse_step"] is not None for x in runs])


def stability_section(r: dict, link) -> str:
    from bench.stability import LEARNED_THRESHOLD

    res = r["results"]
    if "runs" not in next(iter(res.values()), {}):
        return "This file predates the 5-seed stability benchmark from the SFT start: rerun `sao bench stability`."
    threshold = r.get("learned_threshold", LEARNED_THRESHOLD)
    setting = ", ".join(f"`{x}`" for x in r.get("setting", []))
    out = [f"From the SFT start, in a setting where collapse is possible ({setting}): {r.get('steps', '?')} policy "
           f"steps (+{r.get('warmup', '?')} warm-up, given to the group methods as steps), "
           f"{len(next(iter(res.values()))['seeds'])} seeds per algorithm. A run **collapses** when its accuracy "
           f"({r.get('window', 10)}-step moving average) falls below half its running peak and at least 0.1 below it, "
           "or its entropy ends below a tenth of its peak while accuracy ends below the SFT start's, or its "
           "train-rollout logprob gap over the last 10 steps is over 3x that of the first 10 (ratio divergence). "
           + _peak_gain_text(next(iter(res.values()))["runs"])
           + f" A run **learned** when its peak gain exceeds {threshold:.2f}. Grad-norm spikes: steps over 10x the "
           "run's median. " + INTERVAL_NOTE, _arm_lr_text(r)]
    rows = []
    for algo, v in res.items():
        runs = v["runs"]
        gains = [peak_gain(x) for x in runs]
        rows.append([algo, f"{sum(g > threshold for g in gains)} of {len(runs)}",
                     f"{seed_ci({'per_seed': {'x': gains}}, 'x')['mean']:.3f}",
                     f"{v['collapsed']} of {len(runs)}", ", ".join(_kinds(x) for x in runs if x["collapsed"]) or "-",
                     _ci(runs, "final_acc"), _ci(runs, "max_acc_drop"),
                     f"{statistics.fmean(x['grad_norm_spikes'] for x in runs):.1f}",
                     f"{statistics.fmean(x['staleness_mean'] for x in runs):.2f} / "
                     f"{max(x['staleness_max'] for x in runs):.0f}"])
    out.append(md_table(["algorithm", "learned", "peak gain (mean)", "collapsed", "how", "final accuracy",
                         "max drop from peak", "spikes per run", "staleness mean / max"], rows))
    out.append(_every_arm_learned(res, threshold))
    if not any(peak_gain(x) > threshold for v in res.values() for x in v["runs"]):
        out.append(f"No run learned (peak gain above {threshold:.2f}) in this file: every collapse above is a fall "
                   "from the start, not 'learns, then collapses'; the setting is a floor, not a test of stability.")
    out.append(_falls_without_learning(res, threshold))
    if not any(x["collapsed"] for v in res.values() for x in v["runs"]):
        out.append("No run collapsed in this file: it compares learning in this setting, not stability; a claim "
                   "that one method collapses less cannot be tested on it.")
    out.append(survival_text(res))
    if "sao" in res:
        out.append(differences({f"sao - {a}": ([x["final_acc"] for x in res["sao"]["runs"]],
                                               [x["final_acc"] for x in v["runs"]])
                                for a, v in res.items() if a != "sao"}))
    out.append(link("stability.png", "stability"))
    out.append(link("stability_survival.png", "time to collapse"))
    from bench.report_learning import failures_text

    out.append(failures_text(r))
    if r.get("quick"):
        out.append("Only the quick smoke run is recorded: it checks that the benchmark runs; no claim is made.")
    if not r.get("full"):
        out.append(f"The `--full` version (>= 10 seeds per arm, a setting where runs first learn, time to collapse "
                   f"with Kaplan-Meier curves and log-rank tests; bench/stability.py): {NOT_RUN}.")
    return "\n\n".join(x for x in out if x)


def _arm_lr_text(r: dict) -> str:
    """The arms that ran at an lr other than the setting's (stability.FULL_ARM_LR); '' when none did."""
    from bench.stability import setting_lr

    base = setting_lr(r.get("setting", []))
    moved = {a: lr for a, lr in r.get("arm_lr", {}).items() if lr != base}
    if not moved:
        return ""
    return ("Every arm runs at the setting's lr except " + ", ".join(f"{a} at {lr}" for a, lr in moved.items())
            + f": it did not learn at {base} (bench/stability.py, FULL_ARM_LR), so it runs at the highest lower lr "
            "where its pilot seeds learned. Its rows compare each arm at its own lr.")


def _every_arm_learned(res: dict, threshold: float) -> str:
    """Whether this is a setting where every arm first learns (most of its runs): then a collapse would be
    'learns, then collapses'. '' when some arm learned in at most half its runs."""
    shares = [(sum(peak_gain(x) > threshold for x in v["runs"]), len(v["runs"])) for v in res.values()]
    if len(res) < 2 or any(k * 2 <= n for k, n in shares):
        return ""
    least = min(shares, key=lambda s: s[0] / s[1])
    return (f"Every arm first learns in this setting: at least {least[0]} of {least[1]} runs of each arm passed "
            "the learned threshold, so a collapse here would be 'learns, then collapses'.")


def _falls_without_learning(res: dict, threshold: float) -> str:
    """Per arm, the accuracy collapses (collapse_step) of runs that never learned: falls from the start."""
    parts = []
    for algo, v in res.items():
        fell = [x for x in v["runs"] if x.get("collapse_step") is not None]
        unlearned = [x for x in fell if peak_gain(x) <= threshold]
        if unlearned:
            parts.append(f"{algo}: {len(unlearned)} of its {len(fell)}")
    if not parts:
        return ""
    return ("Accuracy collapses in runs that never learned (peak gain at most the threshold), falls from the start "
            "rather than 'learns, then collapses', which the time-to-collapse rows below count all the same: "
            + "; ".join(parts) + ".")


def survival_text(res: dict) -> str:
    """Kaplan-Meier median and end-of-run survival per method; log-rank against SAO, Holm over the rows."""
    times = {a: collapse_times(v["runs"]) for a, v in res.items()}
    if any(t is None for t in times.values()):
        return "Time to collapse: not recorded in this file (no per-run collapse step); rerun `sao bench stability`."
    rows, tests = [], {}
    for algo, (t, e) in times.items():
        curve = kaplan_meier(t, e)
        median = median_survival(curve)
        rows.append([algo, "never reached" if median is None else f"{median:.0f}", f"{curve[-1][1]:.2f}"])
        if algo != "sao" and "sao" in times:
            tests[f"sao vs {algo}"] = logrank(*times["sao"], t, e)
    out = [md_table(["algorithm", "median steps to collapse (Kaplan-Meier)", "share not collapsed at the end"], rows)]
    note = ("Time to collapse counts the accuracy collapse only (the first policy step its condition holds); "
            "entropy collapses and ratio divergence are in the table above.")
    if not any(any(e) for _, e in times.values()):
        note += (" No run's accuracy collapsed in any arm: this setting tests learning under staleness, not "
                 "collapse, so the log-rank test has nothing to compare and the stability claim cannot be "
                 "tested here (cannot tell).")
    out.append(note)
    if tests:
        corrected = holm([x["p"] for x in tests.values()])
        out.append(md_table(["log-rank", "SAO collapsed (expected)", "chi2", "p", f"p, Holm over {len(tests)}"],
                            [[k, f"{x['observed_a']:.0f} ({x['expected_a']:.1f})", f"{x['chi2']:.2f}",
                              f"{x['p']:.3f}", f"{p:.3f}"] for (k, x), p in zip(tests.items(), corrected)]))
    return "\n\n".join(out)


def _ci(runs: list[dict], key: str) -> str:
    from bench.stats import ci_text

    return ci_text(seed_ci({"per_seed": {"x": [x[key] for x in runs]}}, "x"))


def _kinds(run: dict) -> str:
    kinds = [name for key, name in (("reward_collapse", "accuracy"), ("entropy_collapse", "entropy"),
                                    ("ratio_divergence", "ratio")) if run.get(key)]
    return "+".join(kinds)
