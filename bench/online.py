"""Online learning: the rewarded rule switches every K policy steps (task 'online', env/phase).

Compares how fast each method recovers after a switch: SAO (learned value model), a group baseline
(GRPO, 4 rollouts per prompt) and REINFORCE with a running-mean baseline, at the same number of
samples per step. Recovery = policy steps after a switch until the 5-step moving-average reward is back
to 80% of its level just before the switch (None when it never gets there within the phase).
"""
from __future__ import annotations

import statistics
from pathlib import Path

from bench.training_runs import mean_std, plot_curves, series, train_run

METHODS = {
    "sao": ["algorithm.name='sao'"],
    "grpo": ["algorithm.name='grpo'", "rollout.n_samples_per_prompt=4"],
    "running_mean": ["algorithm.name='running_mean'"],
}


def recovery_steps(rows: list[dict], switch_every: int) -> list:
    """Per switch: steps to get back to 80% of the pre-switch moving average."""
    policy_rows = [r for r in rows if "env/phase" in r and "train/pg_loss" in r]
    rewards = [r["rollout/raw_reward"] for r in policy_rows]
    smooth = [statistics.fmean(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
    out = []
    for switch in range(switch_every, len(smooth), switch_every):
        target = 0.8 * smooth[switch - 1]
        after = smooth[switch:switch + switch_every]
        out.append(next((i + 1 for i, v in enumerate(after) if v >= target), None) if target > 0 else 0)
    return out


def run(quick: bool = False, out_dir: Path = Path("results"), full: bool = False) -> dict:
    """quick: SAO, 2 phases of 1 step; default: 3 methods, 1 seed, 3 phases of 30 steps;
    full: 3 methods, 3 seeds, 4 phases of 60 steps."""
    switch_every, phases = (1, 2) if quick else ((60, 4) if full else (30, 3))
    seeds = [1] if quick else ([1, 2, 3] if full else [1])
    methods = ["sao"] if quick else list(METHODS)
    work = out_dir / "runs_online"
    table, curves = {}, {}
    for method in methods:
        recoveries, runs = [], []
        for seed in seeds:
            overrides = METHODS[method] + ["rollout.task='online'", f"rollout.env_switch_every={switch_every}",
                                           f"run.num_steps={switch_every * phases}", "critic.warmup_steps=3",
                                           f"run.seed={seed}"]
            rows = train_run(f"online-{method}-s{seed}", overrides, work)
            recoveries += [r for r in recovery_steps(rows, switch_every)]
            runs.append(series(rows, "rollout/raw_reward"))
        recovered = [r for r in recoveries if r is not None]
        mean, std = mean_std([float(r) for r in recovered])
        table[method] = {"recovery_steps": recoveries, "recovery_mean": mean, "recovery_std": std,
                         "never_recovered": sum(r is None for r in recoveries), "seeds": seeds}
        curves[method] = runs
    plot_curves(curves, f"online: rule switches every {switch_every} policy steps", out_dir / "online.png")
    lines = [f"{'method':14s} {'recovery steps (mean +- std)':>30s} {'never':>6s}"]
    for method, row in table.items():
        lines.append(f"{method:14s} {row['recovery_mean']:22.1f} +- {row['recovery_std']:.1f} {row['never_recovered']:6d}")
    return {"table": table, "switch_every": switch_every, "summary": "\n".join(lines)}
