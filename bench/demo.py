"""`make demo` as a benchmark: `sao bench demo` runs recipes/tiny_sft_sao_cpu.toml (SFT, then SAO).

Trains the demo recipe as `make demo` does (quick: a 2-step SFT, then 2 policy steps after 1 critic
warm-up step) and summarises its metrics: accuracy (share of exactly correct answers) and mean
reward of the first and last 10 RL steps, policy entropy first -> last, wall time of the steps (from
the metrics' timestamps) and the curves plot. An existing run directory (a finished `make demo`) can
be summarised without re-running: `python -m bench.demo --from-run runs/tiny-sft-sao --out-dir results`.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from bench.training_runs import SFT_DEMO, series, train_run

EDGE = 10  # steps averaged at the start and the end of the run


def summarize(rows: list[dict]) -> dict:
    """Reward and entropy at the start and end of a run, and the time its steps took."""
    rewards, entropy = series(rows, "rollout/raw_reward"), series(rows, "train/entropy")
    accuracy = series(rows, "rollout/accuracy")
    span = rows[-1]["time"] - rows[0]["time"] + rows[0].get("perf/step_time_s", 0.0)
    edge = min(EDGE, len(rewards))
    return {"steps": len(rows), "policy_steps": len(entropy), "edge_steps": edge,
            "reward_first": statistics.fmean(rewards[:edge]), "reward_last": statistics.fmean(rewards[-edge:]),
            "accuracy_first": statistics.fmean(accuracy[:edge]) if accuracy else None,
            "accuracy_last": statistics.fmean(accuracy[-edge:]) if accuracy else None,
            "entropy_first": entropy[0] if entropy else None, "entropy_last": entropy[-1] if entropy else None,
            "steps_wall_s": span, "seconds_per_step": span / len(rows)}


def run_setup(run_dir: Path) -> dict:
    """What the run trained: algorithm, task, rollouts per step and model size, from its resolved recipe."""
    import json
    import tomllib

    from parallel.model_shapes import count_parameters

    recipe = tomllib.loads((run_dir / "resolved_recipe.toml").read_text())
    config = Path(recipe["model"]["path"]) / "config.json"
    return {"algorithm": recipe["algorithm"]["name"], "task": recipe["rollout"]["task"],
            "sft_steps": recipe.get("sft", {}).get("steps", 0),
            "rollouts_per_step": recipe["rollout"]["batch_size"], "model_preset": recipe["model"]["init_preset"],
            "model_parameters": count_parameters(json.loads(config.read_text())).total if config.is_file() else None}


def _summary_text(s: dict) -> str:
    entropy = (f"; entropy {s['entropy_first']:.2f} -> {s['entropy_last']:.2f} nats/token"
               if s["entropy_first"] is not None else "")
    accuracy = (f"; accuracy first {s['edge_steps']} steps {s['accuracy_first']:.3f}, last {s['edge_steps']} "
                f"{s['accuracy_last']:.3f}" if s.get("accuracy_first") is not None else "")
    return (f"tiny demo: {s['steps']} RL steps ({s['policy_steps']} policy steps) in {s['steps_wall_s']:.0f} s "
            f"({s['seconds_per_step']:.2f} s/step); mean reward first {s['edge_steps']} steps "
            f"{s['reward_first']:.3f}, last {s['edge_steps']} {s['reward_last']:.3f}{accuracy}{entropy}")


def _plot(metrics: Path, out_dir: Path) -> None:
    from sao_megatron.metrics.plot import plot_curves

    out_dir.mkdir(parents=True, exist_ok=True)
    plot_curves(metrics, out_dir / "tiny_demo_curves.png", title="tiny demo (SFT, then SAO; chain:1:1)")


def run(quick: bool = False, out_dir: Path = Path("results")) -> dict:
    """quick: 1 critic warm-up + 2 policy steps; default: the recipe as `make demo` runs it."""
    work = out_dir / "runs_demo"
    overrides = ["sft.steps=2", "run.num_steps=2", "critic.warmup_steps=1"] if quick else []
    rows = train_run("tiny-sft-sao", overrides, work, recipe=SFT_DEMO)
    _plot(work / "tiny-sft-sao" / "metrics.jsonl", out_dir)
    summary = summarize(rows) | run_setup(work / "tiny-sft-sao")
    return {**summary, "recipe": str(SFT_DEMO.relative_to(SFT_DEMO.parents[1])), "summary": _summary_text(summary)}


def from_run(run_dir: Path, out_dir: Path) -> dict:
    """results/demo.json from a finished run directory (its metrics.jsonl), without training."""
    import json
    import shutil

    from bench.runner import machine

    metrics = run_dir / "metrics.jsonl"
    rows = [r for r in (json.loads(line) for line in metrics.read_text().splitlines() if line) if r.get("step", 0) > 0]
    if (run_dir / "curves.png").is_file():   # the plot the run itself drew (logging.plot)
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run_dir / "curves.png", out_dir / "tiny_demo_curves.png")
    else:
        _plot(metrics, out_dir)
    summary = summarize(rows) | run_setup(run_dir)
    result = {**summary, "recipe": str(SFT_DEMO.relative_to(SFT_DEMO.parents[1])), "summary": _summary_text(summary),
              "bench": "demo", "quick": False, "full": False, "machine": machine(), "wall_s": summary["steps_wall_s"],
              "command": "make demo",
              "note": "summarised from the finished run's metrics.jsonl by python -m bench.demo --from-run; "
                      "machine = the machine that summarised it; wall_s = the steps only (no start-up)"}
    (out_dir / "demo.json").write_text(json.dumps(result, indent=2, default=float))
    return result


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-run", type=Path, required=True, help="a finished `make demo` run directory")
    parser.add_argument("--out-dir", type=Path, default=Path("results"))
    args = parser.parse_args()
    print(from_run(args.from_run, args.out_dir)["summary"])
