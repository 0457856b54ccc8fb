"""SAO vs GRPO vs GRPO+DIS vs GSPO vs PPO (same critic) on tiny verifiable tasks, equal sample budget.

Every algorithm generates the same number of samples: SAO's critic warm-up steps generate samples
too, so group baselines get as many steps as SAO's warm-up plus policy steps. Reports final reward
(mean of the last 5 steps) and area under the reward curve (mean over steps), mean +- std over seeds.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from bench.training_runs import final_and_auc, mean_std, plot_curves, series, train_run

TASKS = ["arithmetic", "copy", "digits"]
GROUP = ["rollout.n_samples_per_prompt=4"]
ALGORITHMS = {
    "sao": ["algorithm.name='sao'"],
    "grpo": ["algorithm.name='grpo'", *GROUP],
    "grpo_dis": ["algorithm.name='grpo_dis'", *GROUP],
    "gspo": ["algorithm.name='gspo'", *GROUP],
    "ppo": ["algorithm.name='ppo'"],
}


def budget_overrides(name: str, steps: int, warmup: int) -> list[str]:
    """Critic methods spend `warmup` sample batches on the critic; group methods get them as steps."""
    if name in ("sao", "ppo"):
        return [f"run.num_steps={steps}", f"critic.warmup_steps={warmup}"]
    return [f"run.num_steps={steps + warmup}"]


def run(quick: bool = False, out_dir: Path = Path("results"), full: bool = False,
        tasks: Optional[list[str]] = None) -> dict:
    """quick: CI smoke (2 runs); default: every task, 5 algorithms x 3 seeds x 60 steps (about 35 min on
    2 CPU cores); full: the same at 150 steps.

    `tasks` runs only those tasks (same sizes) and keeps the other tasks' rows of an existing
    out_dir/algorithms.json measured with the same steps and seeds; `task_runs` records which command,
    machine and wall time produced each task's rows."""
    explicit = tasks is not None
    keep = {} if not explicit or quick else _previous(out_dir / "algorithms.json", full)
    tasks = tasks or list(TASKS)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"bench algorithms: unknown task(s) {unknown}; use {TASKS}")
    algos = ["sao", "grpo"] if quick else list(ALGORITHMS)
    seeds = [1] if quick else [1, 2, 3]
    steps, warmup = (2, 1) if quick else ((150, 3) if full else (60, 3))
    work = out_dir / "runs_algorithms"
    table = {k: v for k, v in keep.get("table", {}).items() if k.split("/")[0] not in tasks}
    curves = {k: v for k, v in keep.get("curves", {}).items() if k not in tasks}
    task_runs = {k: v for k, v in keep.get("task_runs", {}).items() if k not in tasks}
    for task in tasks:
        started = time.perf_counter()
        for algo in algos:
            finals, aucs, runs, samples = [], [], [], set()
            for seed in seeds:
                name = f"{task}-{algo}-s{seed}"
                rows = train_run(name, ALGORITHMS[algo] + budget_overrides(algo, steps, warmup)
                                 + [f"rollout.task='{task}'", f"run.seed={seed}"], work)
                samples.add(len(rows) * _batch_size(work / name))
                rewards = series(rows, "rollout/raw_reward")
                final, auc = final_and_auc(rewards)
                finals.append(final)
                aucs.append(auc)
                runs.append(rewards)
            (fm, fs), (am, as_) = mean_std(finals), mean_std(aucs)
            table[f"{task}/{algo}"] = {"final_mean": fm, "final_std": fs, "auc_mean": am, "auc_std": as_,
                                       "seeds": seeds, "samples_per_run": sorted(samples)}
            curves.setdefault(task, {})[algo] = runs
        task_runs[task] = {"command": "sao bench algorithms" + (" --quick" if quick else "") + (" --full" if full else "")
                           + (f" --tasks {','.join(tasks)}" if explicit else ""),
                           "wall_s": time.perf_counter() - started, "date": time.strftime("%Y-%m-%d")}
    for task, per_algo in curves.items():
        plot_curves(per_algo, f"{task}: reward per step (mean +- std, {len(seeds)} seeds)",
                    out_dir / f"algorithms_{task}.png")
    lines = [f"{'task/algorithm':24s} {'final reward':>18s} {'AUC':>18s}"]
    for key, row in table.items():
        lines.append(f"{key:24s} {row['final_mean']:8.3f} +- {row['final_std']:.3f}   "
                     f"{row['auc_mean']:8.3f} +- {row['auc_std']:.3f}")
    return {"table": table, "curves": curves, "summary": "\n".join(lines), "steps": steps, "warmup": warmup,
            "task_runs": task_runs}


def _batch_size(run_dir: Path) -> int:
    """Samples per step the run trained on (rollout.batch_size of its resolved recipe)."""
    import tomllib

    return tomllib.loads((run_dir / "resolved_recipe.toml").read_text())["rollout"]["batch_size"]


def _previous(path: Path, full: bool) -> dict:
    """An earlier result to extend, when it was measured with the same sizes (else nothing is kept)."""
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    steps = 150 if full else 60
    if old.get("quick") or old.get("steps") != steps or bool(old.get("full")) != full:
        return {}
    if "task_runs" not in old:   # written before per-task provenance: all its tasks came from its command
        old["task_runs"] = {key.split("/")[0]: {"command": old.get("command", ""), "wall_s": old.get("wall_s")}
                            for key in old.get("table", {})}
    return old
