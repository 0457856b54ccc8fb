"""SAO vs GRPO vs GRPO+DIS vs GSPO vs PPO (same critic) on tiny verifiable tasks, equal sample budget.

Every algorithm generates the same number of samples: SAO's critic warm-up steps generate samples
too, so group baselines get as many steps as SAO's warm-up plus policy steps. Reports final reward
(mean of the last 5 steps) and area under the reward curve (mean over steps), mean +- std over seeds.
"""
from __future__ import annotations

from pathlib import Path

from bench.training_runs import final_and_auc, mean_std, plot_curves, series, train_run

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


def run(quick: bool = False, out_dir: Path = Path("results"), full: bool = False) -> dict:
    """quick: CI smoke (2 runs); default: arithmetic, 5 algorithms x 3 seeds x 60 steps;
    full: arithmetic and copy, 5 algorithms x 3 seeds x 150 steps."""
    tasks = ["arithmetic", "copy"] if full else ["arithmetic"]
    algos = ["sao", "grpo"] if quick else list(ALGORITHMS)
    seeds = [1] if quick else [1, 2, 3]
    steps, warmup = (2, 1) if quick else ((150, 3) if full else (60, 3))
    work = out_dir / "runs_algorithms"
    table, curves = {}, {}
    for task in tasks:
        for algo in algos:
            finals, aucs, runs = [], [], []
            for seed in seeds:
                rows = train_run(f"{task}-{algo}-s{seed}", ALGORITHMS[algo] + budget_overrides(algo, steps, warmup)
                                 + [f"rollout.task='{task}'", f"run.seed={seed}"], work)
                rewards = series(rows, "rollout/raw_reward")
                final, auc = final_and_auc(rewards)
                finals.append(final)
                aucs.append(auc)
                runs.append(rewards)
            (fm, fs), (am, as_) = mean_std(finals), mean_std(aucs)
            table[f"{task}/{algo}"] = {"final_mean": fm, "final_std": fs, "auc_mean": am, "auc_std": as_,
                                       "seeds": seeds, "samples_per_run": None}
            curves.setdefault(task, {})[algo] = runs
    for task, per_algo in curves.items():
        plot_curves(per_algo, f"{task}: reward per step (mean +- std, {len(seeds)} seeds)",
                    out_dir / f"algorithms_{task}.png")
    lines = [f"{'task/algorithm':24s} {'final reward':>18s} {'AUC':>18s}"]
    for key, row in table.items():
        lines.append(f"{key:24s} {row['final_mean']:8.3f} +- {row['final_std']:.3f}   "
                     f"{row['auc_mean']:8.3f} +- {row['auc_std']:.3f}")
    return {"table": table, "curves": curves, "summary": "\n".join(lines), "steps": steps, "warmup": warmup}
