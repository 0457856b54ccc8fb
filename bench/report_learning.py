"""Report sections of the learning benchmarks (demo, algorithms, online, stability): what the runs learned.

Each section is `(result, link) -> markdown`, reading only the benchmark's JSON; verdicts say what the
numbers show and what they do not. Intervals are 95% percentile-bootstrap intervals over seeds
(bench/stats.py); the paper's claims, one verdict each, are in bench/report_claims.py.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

from bench.report_format import md_table, pm
from bench.stats import ci_text, verdict

BOOTSTRAP_NOTE = ("[lo, hi] = 95% percentile-bootstrap interval over seeds; with 5 seeds it is narrower than "
                  "the true interval (it cannot show variation the seeds did not).")


def demo_section(r: dict, link) -> str:
    rows = []
    if r.get("accuracy_first") is not None:
        gain = 100 * (r["accuracy_last"] - r["accuracy_first"])
        rows.append([f"accuracy (exactly correct), first {r['edge_steps']} -> last {r['edge_steps']} RL steps",
                     f"{r['accuracy_first']:.3f} -> {r['accuracy_last']:.3f} ({gain:+.1f} points)"])
    rows.append([f"mean reward, first {r['edge_steps']} -> last {r['edge_steps']} RL steps",
                 f"{r['reward_first']:.3f} -> {r['reward_last']:.3f}"])
    if r.get("entropy_first") is not None:
        rows.append(["policy entropy (nats/token), first -> last",
                     f"{r['entropy_first']:.2f} -> {r['entropy_last']:.2f}"])
    rows.append([f"wall time of the {r['steps']} RL steps",
                 f"{r['steps_wall_s']:.0f} s ({r['seconds_per_step']:.2f} s/step)"])
    setup = ""
    if r.get("algorithm"):
        size = f" ({r['model_parameters'] / 1e6:.2f}M parameters)" if r.get("model_parameters") else ""
        start = (f"random init, then {r['sft_steps']} SFT steps" if r.get("sft_steps") else "random init")
        preset = f"the `{r['model_preset']}` Qwen3-MoE preset" if r.get("model_preset") else "the tiny Qwen3-MoE"
        setup = (f" Model: {preset}{size}, {start}; "
                 f"algorithm `{r['algorithm']}`, task `{r['task']}`, {r['rollouts_per_step']} rollouts per step.")
    out = [f"`sao train {r.get('recipe', 'recipes/tiny_sft_sao_cpu.toml')}` (`make demo`): {r['steps']} RL steps, "
           f"{r['policy_steps']} of them policy steps (the rest warm up the critic).{setup}",
           md_table(["", "value"], rows), link("tiny_demo_curves.png", "tiny demo curves"), _demo_verdict(r)]
    return "\n\n".join(x for x in out if x)


def _demo_verdict(r: dict) -> str:
    """The demo's target (issue 19): accuracy up by at least 20 points from the first to the last 10 steps."""
    if r.get("accuracy_first") is None or r.get("quick"):
        return ""
    gain = 100 * (r["accuracy_last"] - r["accuracy_first"])
    return (f"The demo's target, accuracy up by at least 20 points from its first {r['edge_steps']} to its last "
            f"{r['edge_steps']} steps, is {'met' if gain >= 20 else 'NOT met'} in this run ({gain:+.1f} points). "
            "`tests/learning/test_demo_learns.py` holds CI to the same target.")


def algorithms_section(r: dict, link) -> str:
    table, start = r["table"], r.get("start", {})
    tasks = sorted({key.split("/")[0] for key in table})
    seeds = len(r.get("seeds", []))
    out = [f"Every run starts RL from one SFT model (`sao sft {start.get('recipe', '?')}`: {start.get('sft_steps', '?')} "
           f"steps on `{start.get('task', '?')}`) and runs the demo recipe with only the algorithm changed: "
           f"{r.get('steps', '?')} policy steps (+{r.get('warmup', '?')} critic warm-up steps for SAO and PPO, given "
           f"to the group methods as extra steps), {r.get('samples_per_step', '?')} samples per step for every method "
           f"(group methods: 16 prompts x 4), {seeds} seeds. Final = mean accuracy of the last {r.get('edge', 10)} "
           f"steps; gain = final minus the run's first batch (sampled by the SFT model); AUC = mean accuracy over "
           f"all steps. " + BOOTSTRAP_NOTE]
    for task in tasks:
        rows = []
        for key, v in table.items():
            if not key.startswith(task + "/"):
                continue
            algo = key.split("/")[1]
            if algo == "sft_start":
                rows.append(["SFT start (first batch of every run)", ci_text(v["final_acc"]), "", "", "", ""])
                continue
            rows.append([algo, ci_text(v["final_acc"]), ci_text({k: 100 * x if k != "n" else x
                                                                 for k, x in v["gain"].items()}, 1),
                         ci_text(v["auc_acc"]), ci_text(v["final_reward"]),
                         " / ".join(str(n) for n in v.get("samples_per_run", []))])
        out.append(f"**`{task}`**")
        out.append(md_table(["algorithm", "final accuracy", "gain (points)", "AUC accuracy", "final reward",
                             "samples per run"], rows))
        diffs = r.get("comparisons", {}).get(task, {})
        if diffs:
            out.append(md_table(["difference in final accuracy", "mean [95% CI]", "the interval"],
                                [[key.replace("-", " - "), ci_text(d), _says(d)] for key, d in diffs.items()]))
        out.append(link(f"algorithms_{task.replace(':', '_')}.png", f"algorithms {task}"))
        out.append(_ranking(table, task))
    runs = r.get("task_runs", {})
    if runs:
        out.append("Rows per task came from: " + "; ".join(
            f"`{task}`: `{v.get('command', '?')}`" + (f" ({v['wall_s']:.0f} s)" if isinstance(v.get("wall_s"), (int, float)) else "")
            for task, v in sorted(runs.items())) + ".")
    out.append(failures_text(r))
    if not r.get("full"):
        out.append("The `--full` version (300 steps, a second task `chain:2:1`; bench/algorithms.py) was not run.")
    return "\n\n".join(x for x in out if x)


def failures_text(r: dict) -> str:
    """Which training runs failed (the error's first line) and whether their second try was kept."""
    failed = r.get("failed_runs") or []
    if not failed:
        return ""
    kept = [f["run"] for f in failed if f["kept"]]
    lost = [f["run"] for f in failed if not f["kept"]]
    text = (f"{len(failed)} training run(s) failed once ({failed[0]['errors'][0][:160]}"
            + ("; ..." if len(failed) > 1 else "") + ")")
    text += f"; run again from scratch and kept: {', '.join(kept)}" if kept else ""
    text += f"; failed twice and left out of every number above: {', '.join(lost)}" if lost else ""
    return text + "."


def _says(diff: dict) -> str:
    return {"supports": "above 0: the first is higher", "refutes": "below 0: the first is lower",
            "cannot tell": "spans 0: no difference measured"}[verdict(diff)]


def _ranking(table: dict, task: str) -> str:
    rows = {k.split("/")[1]: v for k, v in table.items() if k.startswith(task + "/") and not k.endswith("/sft_start")}
    ranked = sorted(rows, key=lambda a: rows[a]["final_acc"]["mean"], reverse=True)
    text = (f"As measured on `{task}`, by final accuracy: "
            + " > ".join(f"{a} ({rows[a]['final_acc']['mean']:.3f})" for a in ranked) + ".")
    if "sao" in ranked:
        text += f" SAO is {ranked.index('sao') + 1} of {len(ranked)}; whether a gap is real is what the intervals above say."
    return text


def online_section(r: dict, link) -> str:
    table = r["table"]
    seeds = len(next(iter(table.values()))["seeds"]) if table else 0
    rules = r.get("rules")
    out = [f"Task `online`: the rewarded rule switches every {r['switch_every']} trainer steps"
           + (f" ({r['phases']} phases, rules {' -> '.join(rules)})" if rules else "")
           + f", {seeds} seed{'s' if seeds != 1 else ''}, the same samples per step for every method."]
    fraction, window = r.get("recovery_fraction"), r.get("window")
    out.append(f"Recovery = steps after a switch until the moving average of the new phase's last <= {window} steps "
               f"is back at {fraction:.0%} of the mean of the last {window} steps before it ('before'). The first step "
               f"after a switch is left out (its batch may still hold rewards scored under the old rule). 'dip' = mean "
               f"of the next {window} steps; a switch is informative when the dip is below the target (the switch "
               f"knocked the policy back).")
    out.append(md_table(["method", "recovery steps (mean +- std over recovered switches)", "never recovered",
                       "informative switches"],
                      [[m, _recovery_cell(v), f"{v['never_recovered']} of {len(v['switches'])}",
                        f"{v['informative_switches']} of {len(v['switches'])}"] for m, v in table.items()]))
    out.append(md_table(["method", "seed", "switch", "before", "dip", "recovered after (steps in phase)"],
                      [[m, s["seed"], f"{s['from']} -> {s['to']}", f"{s['before']:.3f}", f"{s['dip']:.3f}",
                        f"{'never' if s['recovery_steps'] is None else s['recovery_steps']} ({s['steps_in_phase']})"]
                       for m, v in table.items() for s in v["switches"]]))
    diffs = r.get("comparisons", {})
    if diffs:
        out.append("Recovery steps compared over informative switches, a switch never recovered from counted as "
                   "its whole phase (a lower bound): " + BOOTSTRAP_NOTE.replace("over seeds", "over switches"))
        out.append(md_table(["method", "recovery steps, censored [95% CI]"],
                            [[m, ci_text(v["censored_recovery_ci"], 1)] for m, v in table.items()
                             if "censored_recovery_ci" in v]))
        out.append(md_table(["difference in recovery steps", "mean [95% CI]", "the interval"],
                            [[key.replace("-", " - "), ci_text(d, 1), _says(d).replace("higher", "slower")
                              .replace("lower", "faster")] for key, d in diffs.items()]))
    out.append(link("online.png", "online"))
    out.append(failures_text(r))
    out.append(_online_verdict(table, seeds))
    if not r.get("full"):
        out.append("The `--full` version (4 phases of 60 steps, back to the first style; see bench/online.py) "
                   "was not run.")
    return "\n\n".join(x for x in out if x)


def _recovery_cell(v: dict) -> str:
    recovered = len(v["switches"]) - v["never_recovered"]
    if not recovered:
        return "none recovered"
    if recovered == 1:
        return f"{v['recovery_mean']:.0f} (1 switch)"
    return f"{pm(v['recovery_mean'], v['recovery_std'], 1)} ({recovered} switches)"


def _online_verdict(table: dict, seeds: int) -> str:
    informative = sum(v["informative_switches"] for v in table.values())
    if not informative:
        return ("As measured, and not informative: at no switch did the reward fall below the recovery target, "
                "so 'recovery' measures noise.")
    ranked = sorted((v["recovery_mean"], m) for m, v in table.items() if not math.isnan(v["recovery_mean"]))
    text = "As measured, mean recovery steps (fewest first): " + ", ".join(f"{m} {mean:.1f}" for mean, m in ranked) + "."
    stuck = sorted({s["to"] for v in table.values() for s in v["switches"]}
                   - {s["to"] for v in table.values() for s in v["switches"] if s["recovery_steps"] is not None})
    if stuck:
        text += (f" No method recovered from the switch to {', '.join(stuck)} in any seed: from this start the "
                 "policy does not find that style within a phase, so those switches separate no method.")
    never = [m for m, v in table.items() if v["never_recovered"]]
    if never:
        text += f" Did not recover within a phase at least once: {', '.join(never)}."
    always = [m for m, v in table.items() if not v["never_recovered"] and v["switches"]]
    if always and never:
        text += f" Recovered after every switch: {', '.join(always)}."
    levels = phase_levels(table)
    if levels:
        text += (" Level reached at the end of each phase before a switch (mean over seeds): " + "; ".join(
            f"{phase}: " + ", ".join(f"{m} {level:.3f}" for m, level in sorted(per.items(), key=lambda x: -x[1]))
            for phase, per in levels.items()) + ".")
    text += (" Recovery is measured against each method's own level before the switch ('before'): a method that "
             "learned less in the previous phase has a lower bar, so compare recovery steps together with 'before'.")
    if seeds == 1:
        text += " One seed only: no spread over seeds is measured, so small differences may be noise."
    return text


def phase_levels(table: dict) -> dict[str, dict[str, float]]:
    """Mean 'before' (the reward level at the end of a phase) per phase and method."""
    levels: dict[str, dict[str, list]] = {}
    for method, row in table.items():
        for switch in row.get("switches", []):
            levels.setdefault(switch["from"], {}).setdefault(method, []).append(switch["before"])
    return {phase: {m: statistics.fmean(v) for m, v in per.items()} for phase, per in levels.items()}


def stability_section(r: dict, link) -> str:
    res = r["results"]
    if "runs" not in next(iter(res.values()), {}):
        return "This file predates the 5-seed stability benchmark from the SFT start: rerun `sao bench stability`."
    setting = ", ".join(f"`{x}`" for x in r.get("setting", []))
    out = [f"From the SFT start, in a setting where collapse is possible ({setting}): {r.get('steps', '?')} policy "
           f"steps (+{r.get('warmup', '?')} warm-up, given to the group methods as steps), "
           f"{len(next(iter(res.values()))['seeds'])} seeds per algorithm. A run **collapses** when its final accuracy "
           f"({r.get('window', 10)}-step moving average) is below half its running peak and at least 0.1 below it, "
           "or its entropy ends below a tenth of its peak while accuracy ends below the SFT start's, or its "
           "train-rollout logprob gap over the last 10 steps is over 3x that of the first 10 (ratio divergence). "
           "Grad-norm spikes: steps over 10x the run's median. " + BOOTSTRAP_NOTE]
    rows = []
    for algo, v in res.items():
        runs = v["runs"]
        rows.append([algo, f"{v['collapsed']} of {len(runs)}",
                     ", ".join(_kinds(x) for x in runs if x["collapsed"]) or "-",
                     ci_text(v["final_acc"]), ci_text(v["max_acc_drop"]), f"{v['grad_norm_spikes']['mean']:.1f}",
                     f"{statistics.fmean(x['staleness_mean'] for x in runs):.2f} / "
                     f"{max(x['staleness_max'] for x in runs):.0f}"])
    out.append(md_table(["algorithm", "collapsed", "how", "final accuracy", "max drop from peak",
                         "spikes per run", "staleness mean / max"], rows))
    diffs = r.get("comparisons", {})
    if diffs:
        out.append(md_table(["difference in final accuracy", "mean [95% CI]", "the interval"],
                            [[key.replace("-", " - "), ci_text(d), _says(d)] for key, d in diffs.items()]))
    out.append(link("stability.png", "stability"))
    out.append(failures_text(r))
    if r.get("quick"):
        out.append("Only the quick smoke run is recorded: it checks that the benchmark runs; no claim is made.")
    return "\n\n".join(x for x in out if x)


def _kinds(run: dict) -> str:
    kinds = [name for key, name in (("reward_collapse", "accuracy"), ("entropy_collapse", "entropy"),
                                    ("ratio_divergence", "ratio")) if run.get(key)]
    return "+".join(kinds)
