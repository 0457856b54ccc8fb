"""Long runs: does each algorithm stay stable? Reports collapse signals per algorithm.

Collapse signals (measured, not asserted): the largest drop of the 10-step moving-average reward
from its running peak, the final vs peak entropy ratio (entropy collapse), and grad-norm spikes
(steps whose policy grad norm exceeds 10x the run's median).
"""
from __future__ import annotations

import statistics
from pathlib import Path

from bench.algorithms import ALGORITHMS, budget_overrides
from bench.training_runs import plot_curves, series, train_run


def collapse_signals(rows: list[dict]) -> dict:
    rewards = series(rows, "rollout/raw_reward")
    window = [statistics.fmean(rewards[max(0, i - 9):i + 1]) for i in range(len(rewards))]
    peak, drop = float("-inf"), 0.0
    for value in window:
        peak = max(peak, value)
        drop = max(drop, peak - value)
    entropy = series(rows, "train/entropy")
    norms = series(rows, "train/grad_norm")
    median = statistics.median(norms) if norms else 0.0
    return {
        "max_reward_drop": drop,
        "final_reward": window[-1] if window else float("nan"),
        "entropy_final_over_peak": (entropy[-1] / max(entropy)) if entropy and max(entropy) > 0 else float("nan"),
        "grad_norm_spikes": sum(1 for n in norms if median and n > 10 * median),
        "steps": len(rewards),
    }


def run(quick: bool = False, out_dir: Path = Path("results")) -> dict:
    """quick: 3 steps of SAO; default: the paper's 1000 steps of SAO, GRPO and GRPO+DIS (about 22 min on
    2 CPU cores). There is no longer version: `sao bench stability --full` runs the default."""
    steps = 3 if quick else 1000
    algos = ["sao"] if quick else ["sao", "grpo", "grpo_dis"]
    work = out_dir / "runs_stability"
    results, curves = {}, {}
    for algo in algos:
        rows = train_run(f"stability-{algo}", ALGORITHMS[algo] + budget_overrides(algo, steps, 1 if quick else 10)
                         + ["rollout.task='arithmetic'", "run.seed=1"], work, timeout_s=6 * 3600)
        results[algo] = collapse_signals(rows)
        curves[algo] = [series(rows, "rollout/raw_reward")]
    plot_curves(curves, f"stability: reward over {steps} steps", out_dir / "stability.png")
    lines = [f"{'algorithm':10s} {'steps':>6s} {'final':>7s} {'max drop':>9s} {'H end/peak':>11s} {'spikes':>7s}"]
    for algo, r in results.items():
        lines.append(f"{algo:10s} {r['steps']:6d} {r['final_reward']:7.3f} {r['max_reward_drop']:9.3f} "
                     f"{r['entropy_final_over_peak']:11.3f} {r['grad_norm_spikes']:7d}")
    return {"results": results, "summary": "\n".join(lines)}
