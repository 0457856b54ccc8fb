"""SAO vs GRPO vs GRPO+DIS vs GSPO vs PPO from the SFT start, equal sample budget, 5 seeds.

Every run starts RL from the same SFT model (bench/sft_start.py: the demo's SFT on chain:1:1) and runs
the demo recipe (recipes/tiny_sft_sao_cpu.toml) with only the algorithm changed. Every algorithm
generates the same number of samples: 64 per step (SAO and PPO: 64 prompts x 1; the group methods:
16 prompts x 4), and SAO's and PPO's critic warm-up steps generate samples too, so the group methods
get as many extra steps. Per run: the accuracy of its first batch (sampled by the SFT model itself),
final accuracy and reward (mean of the last 10 steps) and AUC (mean accuracy over all steps). Per
method: the mean over seeds with a 95% percentile-bootstrap interval; per pair of methods the
difference of means with its interval (bench/stats.py), which is what the report's verdicts read.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Optional

from bench.sft_start import TASK, from_sft, sft_info, sft_start
from bench.stats import diff_ci, mean_ci
from bench.training_runs import SFT_DEMO, plot_curves, run_all, series

TASKS = [TASK, "chain:2:1"]
GROUP = ["rollout.n_samples_per_prompt=4"]
ALGORITHMS = {
    "sao": ["algorithm.name='sao'"],
    "grpo": ["algorithm.name='grpo'", *GROUP],
    "grpo_dis": ["algorithm.name='grpo_dis'", *GROUP],
    "gspo": ["algorithm.name='gspo'", *GROUP],
    "ppo": ["algorithm.name='ppo'"],
}
# (higher, lower): the differences the report tests. The first four are the SAO paper's claims
# (SFT 80.4 -> GRPO 84.2 -> GRPO+DIS 93.5 -> SAO 97.3 on AIME25); the last two are this stack's baselines.
COMPARISONS = [("sao", "grpo"), ("sao", "grpo_dis"), ("grpo_dis", "grpo"), ("sao", "gspo"), ("sao", "ppo")]
EDGE = 10   # steps averaged for "final"
WARMUP = 10  # the demo recipe's critic.warmup_steps


def budget_overrides(name: str, steps: int, warmup: int) -> list[str]:
    """Critic methods spend `warmup` sample batches on the critic; group methods get them as steps."""
    if name in ("sao", "ppo"):
        return [f"run.num_steps={steps}", f"critic.warmup_steps={warmup}"]
    return [f"run.num_steps={steps + warmup}"]


def run_metrics(rows: list[dict]) -> dict:
    """One run's numbers: start (first batch), final (last EDGE steps) and AUC of accuracy, final reward."""
    acc, reward = series(rows, "rollout/accuracy"), series(rows, "rollout/raw_reward")
    if not acc:
        return {"start_acc": float("nan"), "final_acc": float("nan"), "auc_acc": float("nan"),
                "final_reward": float("nan"), "gain": float("nan")}
    final = statistics.fmean(acc[-EDGE:])
    return {"start_acc": acc[0], "final_acc": final, "auc_acc": statistics.fmean(acc),
            "final_reward": statistics.fmean(reward[-EDGE:]) if reward else float("nan"), "gain": final - acc[0]}


def run(quick: bool = False, out_dir: Path = Path("results"), full: bool = False,
        tasks: Optional[list[str]] = None, jobs: int = 1) -> dict:
    """quick: CI smoke (SAO and GRPO, 1 seed, 2 steps, a 2-step SFT); default: chain:1:1, 5 algorithms
    x 5 seeds x 100 policy steps (about 20 min on 2 CPU cores with jobs=2); full: both tasks, 300 steps.

    `tasks` runs only those tasks (same sizes) and keeps the other tasks' rows of an existing
    out_dir/algorithms.json measured with the same steps and seeds."""
    explicit = tasks is not None
    keep = {} if not explicit or quick else _previous(out_dir / "algorithms.json", full)
    tasks = tasks or (list(TASKS) if full else [TASK])
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"bench algorithms: unknown task(s) {unknown}; use {TASKS}")
    algos = ["sao", "grpo"] if quick else list(ALGORITHMS)
    seeds = [1] if quick else [1, 2, 3, 4, 5]
    steps, warmup = (2, 1) if quick else ((300, WARMUP) if full else (100, WARMUP))
    model = sft_start(out_dir, quick)
    work = out_dir / "runs_algorithms"
    table = {k: v for k, v in keep.get("table", {}).items() if k.split("/")[0] not in tasks}
    curves = {k: v for k, v in keep.get("curves", {}).items() if k not in tasks}
    comparisons = {k: v for k, v in keep.get("comparisons", {}).items() if k not in tasks}
    task_runs = {k: v for k, v in keep.get("task_runs", {}).items() if k not in tasks}
    failed: list[dict] = []
    for task in tasks:
        started = time.perf_counter()
        specs = [(f"{_slug(task)}-{algo}-s{seed}", ALGORITHMS[algo] + budget_overrides(algo, steps, warmup)
                  + from_sft(model) + [f"rollout.task='{task}'", f"run.seed={seed}"])
                 for algo in algos for seed in seeds]
        rows = run_all(specs, work, jobs=jobs, recipe=SFT_DEMO, failures=failed)
        per_algo = {}
        for algo in algos:
            names = [n for n in (f"{_slug(task)}-{algo}-s{seed}" for seed in seeds) if n in rows]
            if not names:
                raise RuntimeError(f"bench algorithms: every {algo} run on {task} failed twice: {failed}")
            runs = [run_metrics(rows[n]) for n in names]
            per_algo[algo] = {key: [r[key] for r in runs] for key in runs[0]}
            table[f"{task}/{algo}"] = {
                "final_acc": mean_ci(per_algo[algo]["final_acc"]), "auc_acc": mean_ci(per_algo[algo]["auc_acc"]),
                "final_reward": mean_ci(per_algo[algo]["final_reward"]), "gain": mean_ci(per_algo[algo]["gain"]),
                "per_seed": per_algo[algo], "seeds": [int(n.rsplit("-s", 1)[1]) for n in names],
                "samples_per_run": sorted({len(rows[n]) * _batch_size(work / n) for n in names})}
            curves.setdefault(task, {})[algo] = [series(rows[n], "rollout/accuracy") for n in names]
        starts = [x for v in per_algo.values() for x in v["start_acc"]]
        table[f"{task}/sft_start"] = {"final_acc": mean_ci(starts), "runs": len(starts)}
        comparisons[task] = {f"{a}-{b}": diff_ci(per_algo[a]["final_acc"], per_algo[b]["final_acc"])
                             for a, b in COMPARISONS if a in per_algo and b in per_algo}
        task_runs[task] = {"command": "sao bench algorithms" + (" --quick" if quick else "") + (" --full" if full else "")
                           + (f" --tasks {','.join(tasks)}" if explicit else ""),
                           "wall_s": time.perf_counter() - started, "date": time.strftime("%Y-%m-%d"), "jobs": jobs}
    for task, per in curves.items():
        plot_curves(per, f"{task} from the SFT start: accuracy per step (mean +- std, {len(seeds)} seeds)",
                    out_dir / f"algorithms_{_slug(task)}.png", ylabel="accuracy")
    return {"table": table, "curves": curves, "comparisons": comparisons, "summary": _summary(table),
            "steps": steps, "warmup": warmup, "seeds": seeds, "edge": EDGE, "task_runs": task_runs,
            "start": sft_info(model), "samples_per_step": 64, "failed_runs": failed}


def _slug(task: str) -> str:
    return task.replace(":", "_")


def _summary(table: dict) -> str:
    lines = [f"{'task/algorithm':22s} {'final accuracy [95% CI]':>28s} {'AUC accuracy [95% CI]':>28s}"]
    for key, row in table.items():
        f = row["final_acc"]
        auc = row.get("auc_acc")
        lines.append(f"{key:22s} {f['mean']:8.3f} [{f['lo']:.3f}, {f['hi']:.3f}]      "
                     + (f"{auc['mean']:8.3f} [{auc['lo']:.3f}, {auc['hi']:.3f}]" if auc else "(first batch)"))
    return "\n".join(lines)


def _batch_size(run_dir: Path) -> int:
    """Samples per step the run trained on (rollout.batch_size of its resolved recipe)."""
    import tomllib

    return tomllib.loads((run_dir / "resolved_recipe.toml").read_text())["rollout"]["batch_size"]


def _previous(path: Path, full: bool) -> dict:
    """An earlier result to extend, when it was measured with the same sizes (else nothing is kept)."""
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    steps = 300 if full else 100
    if old.get("quick") or old.get("steps") != steps or bool(old.get("full")) != full or "comparisons" not in old:
        return {}
    return old
