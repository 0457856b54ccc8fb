"""Report sections of the learning benchmarks (demo, algorithms, online, stability): what the runs learned.

Each section is `(result, link) -> markdown`, reading only the benchmark's JSON; verdicts say what the
numbers show and what they do not. Intervals and tests are recomputed here from the per-seed numbers
(the seed is the unit: bench/stats.py, bench/report_tests.py); the paper's claims, one verdict each, are
in bench/report_claims.py.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

from bench.report_format import md_table, pm, task_order
from bench.report_tests import INTERVAL_NOTE, differences, seed_ci
from bench.stats import ci_text

NOT_RUN = "not yet run at full size"


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
    table = r["table"]
    tasks = task_order(r)
    seeds = len(r.get("seeds", []))
    out = [f"Every run starts RL from its task's SFT model and runs the task's recipe with only the algorithm "
           f"changed: the critic's warm-up steps for SAO and PPO are given to the methods without a critic as extra "
           f"steps, and every method trains on the same samples per step (group methods: a quarter of the prompts "
           f"x 4), {seeds} seeds. Final = mean accuracy of the last {r.get('edge', 10)} steps; gain = final minus "
           f"the run's first batch (sampled by the SFT model); AUC = mean accuracy over all steps. " + INTERVAL_NOTE]
    for task in tasks:
        rows = []
        for key, v in table.items():
            if not key.startswith(task + "/"):
                continue
            algo = key.split("/")[1]
            if algo == "sft_start":
                starts = [x for k, w in table.items() if k.startswith(task + "/") and "per_seed" in w
                          for x in w["per_seed"]["start_acc"]]
                rows.append(["SFT start (first batch of every run)",
                             ci_text(seed_ci({"per_seed": {"s": starts}}, "s") if starts else v["final_acc"]),
                             "", "", "", "", "", "", ""])
                continue
            wall = v.get("per_seed", {}).get("wall_s")
            rows.append([algo, ci_text(seed_ci(v, "final_acc")), ci_text(seed_ci(v, "heldout_acc")),
                         ci_text(seed_ci(v, "gain", 100), 1),
                         ci_text(seed_ci(v, "auc_acc")), ci_text(seed_ci(v, "final_reward")),
                         " / ".join(str(n) for n in v.get("samples_per_run", [])),
                         f"{v['lr']:g}" if v.get("lr") else "recipe's",
                         f"{statistics.fmean(wall):.0f}" if wall else "not recorded"])
        out.append(f"**`{task}`**" + _task_design(r, task))
        held = (r.get("task_runs", {}).get(task, {}).get("eval") or "none: this task has no held-out split")
        out.append(md_table(["algorithm", "final accuracy", f"held-out accuracy ({held})", "gain (points)",
                             "AUC accuracy", "final reward", "samples per run", "policy lr", "wall s per run"], rows))
        out.append(differences(_pairs(r, task)))
        out.append(link(f"algorithms_{task.replace(':', '_')}.png", f"algorithms {task}"))
        out.append(_ranking(table, task))
    runs = r.get("task_runs", {})
    if runs:
        out.append("Rows per task came from: " + "; ".join(
            f"`{task}`: `{v.get('command', '?')}`" + _task_wall(v) for task, v in runs.items()) + ".")
    out.append(failures_text(r))
    out.append(_lr_sweep_text(r))
    if r.get("full"):
        out.append(_missing_full_tasks(r))
    else:
        out.append(f"The `--full` version (>= 10 fresh seeds per arm: every arm on the long-horizon `scratch:4` "
                   f"task, SAO and both ablation arms on the multi-turn `agent` task, a learning-rate sweep per arm "
                   f"chosen on held-out prompts, a bf16 engine against the fp32 trainer; bench/algorithms.py "
                   f"FULL_DESIGN): {NOT_RUN}." + _progress_text())
    return "\n\n".join(x for x in out if x)


def _task_design(r: dict, task: str) -> str:
    """A task's SFT start, steps, samples per step and arms (task_runs; older files kept them once, at the top)."""
    run = r.get("task_runs", {}).get(task, {})
    start = run.get("start") or r.get("start", {})
    steps = run.get("steps", r.get("steps", "?"))
    warmup = run.get("warmup", r.get("warmup", "?"))
    samples = run.get("samples_per_step") or (r.get("samples_per_step", "?") if len(task_order(r)) == 1 else "?")
    arms = f"; the design's arms on this task: {', '.join(run['arms'])}" if run.get("arms") else ""
    return (f" (from `sao sft {start.get('recipe', '?')}`: {start.get('sft_steps', '?')} steps on "
            f"`{start.get('task', task)}`; {steps} policy steps, +{warmup} critic warm-up steps; {samples} samples "
            f"per step{arms})")


def _task_wall(run: dict) -> str:
    """A task's wall time: the invocation's and, when it records them, its training runs' own seconds
    (which is what the design cost when most runs were read back from the archive)."""
    wall, runs_wall = run.get("wall_s"), run.get("runs_wall_s")
    if not isinstance(wall, (int, float)):
        return ""
    if not isinstance(runs_wall, (int, float)) or not runs_wall:
        return f" ({wall:.0f} s)"
    reused, runs = run.get("reused"), run.get("runs", "?")
    if isinstance(reused, int) and reused > 0:      # read back: how many ran side by side then is not recorded
        how = "as recorded when each ran" + ("" if reused == runs else f"; {reused} of them read back")
    else:
        how = f"{run.get('jobs') or 1} at a time"
    return (f" ({wall:.0f} s for this invocation; its {runs} training runs took {runs_wall / 3600:.1f} h, {how})")


def _missing_full_tasks(r: dict) -> str:
    """The full design's tasks this file does not hold yet, with how far the archive is on each."""
    from bench import algorithms

    missing = [t for t in algorithms.TASKS_FULL if t not in r.get("task_runs", {})]
    if not missing:
        return ""
    progress = algorithms.full_progress()
    parts = [f"`{task}` ({', '.join(algorithms.design(task, quick=False, full=True)[0])}): {NOT_RUN}; the run archive "
             f"holds {progress[task]['sweep_archived']} of {progress[task]['sweep']} sweep runs and "
             f"{progress[task]['fresh_archived']} of {progress[task]['fresh']} fresh-seed runs, read back by "
             f"`sao bench algorithms --full --tasks {task} --resume`" for task in missing]
    return "The full design's other task" + ("s" if len(missing) > 1 else "") + ": " + "; ".join(parts) + "."


def _progress_text() -> str:
    """How many of the full design's runs the run archive holds (they are read back by `--resume`)."""
    from bench import algorithms

    progress = algorithms.full_progress()
    if not any(v["sweep_archived"] + v["fresh_archived"] for v in progress.values()):
        return ""
    parts = [f"`{task}` {v['sweep_archived']} of {v['sweep']} sweep runs and {v['fresh_archived']} of {v['fresh']} "
             f"fresh-seed runs" for task, v in progress.items()]
    sweeps = [f"`{task}` {arm}: " + ", ".join(f"{lr} -> {acc:.3f}" for lr, acc in v["heldout"].items())
              + f" (chosen {v['chosen']:g})" for task, p in progress.items() for arm, v in p["sweeps_done"].items()]
    return (f" Its finished runs so far, kept in `{algorithms._shown(algorithms.ARCHIVE / 'algorithms')}` and read back "
            f"by `sao bench algorithms --full --resume` on any machine: " + "; ".join(parts) + "."
            + (f" Learning-rate sweeps complete so far (mean held-out avg@{algorithms.EVAL_K} of the last evaluation "
               f"over sweep seeds {', '.join(map(str, algorithms.SWEEP_SEEDS))}, computed from the archive; no claim "
               f"rests on them): " + "; ".join(sweeps) + "." if sweeps else ""))


def _pairs(r: dict, task: str) -> dict:
    """The differences the benchmark tests (bench/algorithms.py COMPARISONS), from per-seed final accuracy."""
    from bench.algorithms import COMPARISONS

    table = r["table"]
    seeds = {a: table[f"{task}/{a}"]["per_seed"]["final_acc"] for a in {x for pair in COMPARISONS for x in pair}
             if "per_seed" in table.get(f"{task}/{a}", {})}
    return {f"{a} - {b}": (seeds[a], seeds[b]) for a, b in COMPARISONS if a in seeds and b in seeds}


def _lr_sweep_text(r: dict) -> str:
    """The learning rate each arm was run with and how it was chosen (held-out accuracy of the sweep)."""
    sweep = r.get("lr_sweep")
    if not sweep:
        return ""
    parts = [f"{arm}: " + ", ".join(f"{float(lr):g} -> {acc:.3f}" for lr, acc in sorted(v["heldout"].items(),
                                                                                  key=lambda x: float(x[0])))
             + f" (chosen {v['chosen']:g}, by {_SCORES.get(v['score'], v['score'])})" for arm, v in sweep.items()]
    return ("Learning rate per arm, chosen over a sweep on seeds not used above (mean over "
            f"{len(next(iter(sweep.values()))['seeds'])} sweep seeds): " + "; ".join(parts) + ".")


_SCORES = {"heldout_acc": "held-out accuracy, eval prompts disjoint from the training prompts",
           "final_acc": "final training accuracy: the task has no disjoint held-out split"}


def failures_text(r: dict) -> str:
    """Which training runs failed (the error's first line) and whether their second try was kept, and how
    many were read back from an earlier invocation (`--resume`)."""
    reused = r.get("reused_runs") or []
    where = (f"same out dir or the run archive `{r['archive']}` (bench/run_archive.py: kept in the checkout, so "
             f"a design outlasts a machine)" if r.get("archive") else "same out dir")
    resumed = (f"{len(reused)} training run(s) were read back from an earlier, interrupted invocation in the "
               f"{where} (`--resume`: same settings and start weights, finished), their wall times as recorded then."
               if reused else "")
    return " ".join(x for x in (_failed_text(r), resumed) if x)


def _failed_text(r: dict) -> str:
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


def _ranking(table: dict, task: str) -> str:
    rows = {k.split("/")[1]: v for k, v in table.items() if k.startswith(task + "/") and not k.endswith("/sft_start")}
    ranked = sorted(rows, key=lambda a: rows[a]["final_acc"]["mean"], reverse=True)
    text = (f"As measured on `{task}`, by final accuracy: "
            + " > ".join(f"{a} ({rows[a]['final_acc']['mean']:.3f})" for a in ranked) + ".")
    if "sao" in ranked:
        text += (f" SAO is {ranked.index('sao') + 1} of {len(ranked)}; whether a gap is real is what the "
                 "corrected tests above say.")
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
    from bench.report_claims import recovery_per_seed

    per_seed = {m: recovery_per_seed(v) for m, v in table.items()}
    if "sao" in per_seed and len(per_seed) > 1:
        out.append("Recovery steps with the seed as the unit: per seed, the mean over its informative switches, a "
                   "switch never recovered from counted as its whole phase (a lower bound). " + INTERVAL_NOTE)
        out.append(md_table(["method", "seeds", "recovery steps, censored [95% CI]"],
                            [[m, len(v), ci_text(seed_ci({"per_seed": {"x": v}}, "x"), 1)]
                             for m, v in per_seed.items()]))
        out.append(differences({f"{m} - sao": (v, per_seed["sao"]) for m, v in per_seed.items() if m != "sao"},
                               digits=1, what="recovery steps (positive: sao faster)"))
    out.append(phase_auc_text(table, r.get("reachable_level", 0.05)))
    out.append(link("online.png", "online"))
    out.append(failures_text(r))
    out.append(_online_verdict(table, seeds))
    if not r.get("full"):
        out.append("The `--full` version (10 seeds from random init, 4 phases ending with a return to the first "
                   "rule, each phase's start level measured, per-phase reward AUC with the seed as the unit; see "
                   f"bench/online.py): {NOT_RUN}.")
    return "\n\n".join(x for x in out if x)


def phase_auc_text(table: dict, level: float) -> str:
    """Per-phase reward AUC (mean reward over the phase's policy steps), one number per seed, and the
    differences against SAO over every phase after the first. '' for files that predate it."""
    if "sao" not in table or "auc_per_seed" not in table["sao"]:
        return ""
    phases = table["sao"]["phase_auc"]            # {phase label: [per-seed AUC]}
    rows = [[m, *[ci_text(seed_ci({"per_seed": {"x": v["phase_auc"][ph]}}, "x")) for ph in phases],
             ci_text(seed_ci({"per_seed": {"x": v["auc_per_seed"]}}, "x"))] for m, v in table.items()]
    rows += [[f"{m}: reachable at its start (level >= {level:g}), seeds", *[
        f"{v['reachable'][ph]} of {len(v['phase_start'][ph])}" for ph in phases], ""] for m, v in table.items()]
    return "\n\n".join([
        "Reward AUC per phase (mean reward over the phase's policy steps; per seed, then over seeds), and in "
        "how many seeds each phase was reachable at its start (its first steps' mean reward at least the level):",
        md_table(["method", *phases, "every phase after the first"], rows),
        differences({f"sao - {m}": (table["sao"]["auc_per_seed"], v["auc_per_seed"]) for m, v in table.items()
                     if m != "sao"}, what="reward AUC after the first phase")])


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
