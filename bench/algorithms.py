"""SAO vs its baselines and ablations from an SFT start, at an equal sample budget.

Default (the runs in results/algorithms.json): chain:1:1, SAO / GRPO / GRPO+DIS / GSPO / PPO, 5 seeds,
the demo recipe (recipes/tiny_sft_sao_cpu.toml) with only the algorithm changed.

--full (issue 30; hours on 2 CPU cores, under way): the arms of ARMS_FULL, which isolate SAO's parts
  - the critic: SAO vs `running_mean` (single rollout, advantage = reward - running mean, no critic);
  - single rollout vs groups: SAO vs GRPO+DIS (same DIS loss);
  - DIS vs PPO-clip: SAO vs `sao_ppo_clip` (SAO with the PPO clip 0.2 / 0.2 in place of DIS, same critic);
  on two tasks where those parts have work (TASKS_FULL): `scratch:4` (four chained operations written
  out in a 20-40 character scratchpad, reward only on the final answer, held-out eval prompts disjoint
  from the training prompts) and `agent` (the multi-turn python-tool agent of recipes/tiny_agent_cpu.toml,
  trained on chain:1:1:train and evaluated by its own episodes on the held-out chain:1:1:eval problems,
  eval set tool_task; FULL_DESIGN gives it SAO and the two ablation arms at 100 steps, every arm on scratch);
  with the engine in bf16 against the fp32 trainer (rollout.engine_dtype), a real train/inference
  mismatch for DIS to correct. Per arm, a learning-rate sweep (LR_GRID) on SWEEP_SEEDS picks the lr with
  the best held-out accuracy; then FULL_SEEDS fresh seeds run at that lr.

  How big that mismatch is (one check, 6 SAO steps of the demo recipe from a 2-step SFT, 2026-12-04):
  fp32 engine: train/train_rollout_logprob_abs_diff 0.0 exactly, ratios 1.0; bf16 engine: 7e-4 per token,
  ratios within [0.9975, 1.004]. Real, but far inside DIS's band (0.7, 6.0): on this model the mismatch
  alone gives DIS little to drop; staleness (rollout.staleness_bound) is the larger source of off-policy
  tokens.

  The first sweep (SAO and GRPO on scratch:4 from the demo's 200-step SFT start, 2 seeds x 1e-4 / 3e-4 /
  1e-3 x 300 steps, 2026-12-05) learned nothing: that start is near the floor (held-out avg@4 0.13),
  1e-4 stayed level (training accuracy 0.08-0.12), 3e-4 and 1e-3 fell to 0. So scratch starts from
  SCRATCH_SFT_STEPS = 400 steps (held-out avg@4 0.28, pass@4 0.59: room to learn; 600 and 1000 steps give
  0.76 and 0.88, little room left). From there, one seed, 160 steps (2026-12-05): SAO at 1e-4 rises from
  0.34 to 0.51 training accuracy (held-out 0.38 -> 0.47), GRPO at 1e-4 from 0.37 to 0.48 (0.38 -> 0.47);
  at 3e-4 both fall (SAO to 0.07, GRPO to 0.17). Hence LR_GRID 3e-5 / 1e-4 / 3e-4 and FULL_STEPS 200.
  The sweep on that start (2 seeds, 200 steps; the first 15 of 42 runs, 2026-12-05; training accuracy of
  the last 25 steps, last held-out avg@4 in brackets): SAO, GRPO and GRPO+DIS, the arms run so far, learn
  at 3e-5 and 1e-4; SAO 1e-4 0.60 / 0.58 (0.60 / 0.54), GRPO 1e-4 0.56 / 0.58 (0.59 / 0.49), GRPO+DIS
  3e-5 0.47 / 0.47 (0.53 / 0.52). At 3e-4 SAO falls within 25 steps (0.26 -> 0.09, 0.28 -> 0.12) while
  GRPO declines over all 200 (to 0.06 and 0.17). GSPO's first 6 sweep runs are void: they ran before
  17344e2, when a batch that packed into one micro-batch gave GSPO one optimizer step with its ratio
  exactly 1 (no clipping) instead of its 4 mini-batches; they were set aside. Rerun at 17344e2 (per 25
  steps, first -> last full block; last held-out avg@4): GSPO learns at 3e-5 (0.36 -> 0.52, 0.38 -> 0.52;
  held-out 0.58 / 0.57), drifts at 1e-4 (0.35 -> 0.24, 0.38 -> 0.40; 0.29 / 0.36) and falls at 3e-4
  (to 0.03 / 0.07).
  At 2e-4 (one seed each, a pilot for a stability setting where arms learn and then collapse,
  2026-12-05) SAO stays level (0.32 -> 0.32) and GRPO rises slowly (0.38 -> 0.48, held-out 0.40 ->
  0.47): on this task the lr moves a run from learning to falling at once, with no learn-then-collapse
  in between.

  The agent task, one SAO pilot (seed 101, lr 1e-4, 30 policy steps from its recipe's 400-step SFT start,
  bf16 engine, 2026-12-05, sharing the CPU with the scratch sweep): training accuracy 0.49 / 0.46 / 0.47 /
  0.45 / 0.58 / 0.55 / 0.54 per 5 steps, 2.0 turns per episode, 10.3 s per step (critic 7.1 s, policy
  2.7 s, rollout wait 0.2 s). At that pace a 200-step run takes about 35 min, and the task's 112 runs
  about 30 h two at a time: more than this machine gives. Hence FULL_DESIGN: on the agent task SAO,
  running_mean and sao_ppo_clip only (the comparisons that isolate the critic and DIS; 48 runs) at 100
  policy steps (the pilot moved within 30). The critic's 2 updates a step are the recipe's and stay.

Across machines: the full design outlasts a session's machine, and a new session may get a fresh
one (the out dir of 2026-12-05, outside the checkout, was gone the next day with its 46 finished runs).
So every --full run is also written to the run archive, results/archive/algorithms (bench/run_archive.py,
about 40 KB a run, committed), and `sao bench algorithms --full --tasks scratch:4 --jobs 2 --resume`
(then `--tasks agent`) carries on from it on any machine; docs/results.md counts what it holds.

Equal samples: every arm generates the recipe's rollout.batch_size samples per step (single-rollout arms:
batch_size prompts x 1; group arms: batch_size / 4 prompts x 4), and the critic's warm-up batches are
given to the arms without a critic as extra steps. Per run: start (first batch, the SFT model), final
accuracy (mean of the last EDGE steps), AUC, held-out accuracy where the task has an eval split, wall time.
Tests over seeds: bench/stats.py (the report recomputes them from the per-seed numbers).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Optional

from bench import REPO
from bench.run_archive import ARCHIVE, keep_start, restore_start
from bench.sft_start import TASK, from_sft, sft_info, sft_start
from bench.stats import compare, mean_ci
from bench.training_runs import SFT_DEMO, plot_curves, run_all, series

AGENT_RECIPE = REPO / "recipes" / "tiny_agent_cpu.toml"
TASKS = [TASK, "chain:2:1"]
TASKS_FULL = ["scratch:4", "agent"]
GROUP = ["rollout.n_samples_per_prompt=4"]
ALGORITHMS = {
    "sao": ["algorithm.name='sao'"],
    "grpo": ["algorithm.name='grpo'", *GROUP],
    "grpo_dis": ["algorithm.name='grpo_dis'", *GROUP],
    "gspo": ["algorithm.name='gspo'", *GROUP],
    "ppo": ["algorithm.name='ppo'"],
}
ARMS_FULL = {
    **ALGORITHMS,
    "running_mean": ["algorithm.name='running_mean'"],
    "sao_ppo_clip": ["algorithm.name='sao'", "algorithm.loss='ppo'", "algorithm.eps_low=0.2", "algorithm.eps_high=0.2"],
}
CRITIC_ARMS = ("sao", "ppo", "sao_ppo_clip")
# (first, second): the differences the report tests. The first four are the SAO paper's claims; sao-ppo,
# sao-sao_ppo_clip (DIS vs PPO-clip, same critic) and sao-running_mean (critic vs none) isolate its parts.
COMPARISONS = [("sao", "grpo"), ("sao", "grpo_dis"), ("grpo_dis", "grpo"), ("sao", "gspo"), ("sao", "ppo"),
               ("sao", "sao_ppo_clip"), ("sao", "running_mean")]
EDGE = 10     # steps averaged for "final"
WARMUP = 10   # the demo recipe's critic.warmup_steps
FULL_STEPS, FULL_SEEDS, SWEEP_SEEDS = 200, list(range(1, 11)), [101, 102]
LR_GRID = [3e-5, 1e-4, 3e-4]
MISMATCH = ["rollout.engine_dtype='bf16'"]     # the engine in bf16, the trainer in fp32
EVAL_K, EVAL_PROBLEMS = 4, 64
SCRATCH_SFT_STEPS = 400   # scratch:4 from 200 / 400 / 600 / 1000 SFT steps: held-out avg@4 0.13 / 0.28 / 0.76 / 0.88


# --full, per task: arms and policy steps. scratch:4 runs every arm; the agent task, whose steps cost
# about 3x scratch's (module docstring), runs SAO and the two ablation arms (the critic: running_mean;
# DIS: sao_ppo_clip) for half the steps, so both ablations are tested on two tasks in a time this
# machine gives (3 arms x (3 lrs x 2 sweep seeds + 10 seeds) = 48 runs).
FULL_DESIGN = {"scratch:4": {"arms": list(ARMS_FULL), "steps": FULL_STEPS},
               "agent": {"arms": ["sao", "running_mean", "sao_ppo_clip"], "steps": 100}}
AGENT_EVAL = "tool_task:chain:1:1:eval"      # the agent's own episodes on the 30 held-out chain:1:1 problems


def task_setup(task: str, quick: bool = False) -> dict:
    """How a task runs: recipe, overrides for SFT and RL, its held-out eval set ('' = none)."""
    if task == "agent":
        # absolute: `sao sft` runs inside the out dir, where the recipe's relative path does not resolve
        return {"recipe": AGENT_RECIPE, "sft": [f"sft.dataset='{REPO / 'data' / 'agent' / 'tool_sft.jsonl'}'"],
                "rl": [f"eval.datasets=['{AGENT_EVAL}']", "eval.interval=25", f"eval.k={EVAL_K}", "eval.max_problems=0"],
                "eval": AGENT_EVAL, "start": "sft_start_agent"}
    if task.startswith("scratch"):
        rl = [f"rollout.task='{task}'", "rollout.max_new_tokens=48"]
        eval_every, problems = (3, 8) if quick else (25, EVAL_PROBLEMS)   # quick: once, at its last step
        return {"recipe": SFT_DEMO, "sft": [f"rollout.task='{task}'"], "eval": f"task:{task}:eval",
                "rl": rl + [f"eval.datasets=['task:{task}:eval']", f"eval.interval={eval_every}",
                            f"eval.k={EVAL_K}", f"eval.max_problems={problems}"],
                "start": f"sft_start_{_slug(task)}", "sft_steps": SCRATCH_SFT_STEPS}
    return {"recipe": SFT_DEMO, "sft": [], "rl": [f"rollout.task='{task}'"], "eval": "", "start": "sft_start"}


def budget_overrides(name: str, steps: int, warmup: int) -> list[str]:
    """Critic methods spend `warmup` sample batches on the critic; the others get them as steps."""
    if name in CRITIC_ARMS:
        return [f"run.num_steps={steps}", f"critic.warmup_steps={warmup}"]
    return [f"run.num_steps={steps + warmup}"]


def heldout_accuracy(rows: list[dict]) -> float:
    """The last held-out evaluation's avg@k (eval/<set>/avg@K), NaN when the run evaluated nothing."""
    values = [v for r in rows for k, v in r.items() if k.startswith("eval/") and k.endswith(f"/avg@{EVAL_K}")]
    return values[-1] if values else float("nan")


def run_metrics(rows: list[dict]) -> dict:
    """One run's numbers: start (first batch), final (last EDGE steps), AUC, final reward, held-out accuracy."""
    acc, reward = series(rows, "rollout/accuracy"), series(rows, "rollout/raw_reward")
    if not acc:
        return {"start_acc": float("nan"), "final_acc": float("nan"), "auc_acc": float("nan"),
                "final_reward": float("nan"), "gain": float("nan"), "heldout_acc": float("nan")}
    final = statistics.fmean(acc[-EDGE:])
    return {"start_acc": acc[0], "final_acc": final, "auc_acc": statistics.fmean(acc),
            "final_reward": statistics.fmean(reward[-EDGE:]) if reward else float("nan"), "gain": final - acc[0],
            "heldout_acc": heldout_accuracy(rows)}


def choose_lr(per_lr: dict[float, list[float]]) -> float:
    """The lr with the best mean held-out score over the sweep seeds (ties: the smaller lr)."""
    return min(per_lr, key=lambda lr: (-statistics.fmean(per_lr[lr]), lr))


def run(quick: bool = False, out_dir: Path = Path("results"), full: bool = False,
        tasks: Optional[list[str]] = None, jobs: int = 1, resume: bool = False,
        archive: Optional[Path] = None) -> dict:
    """quick: scratch:4 with its held-out eval, SAO and running_mean, 1 seed of 2 steps from a 2-step SFT;
    default: chain:1:1, 5 arms x 5 seeds x 100 policy steps (about 20 min on 2 CPU cores with jobs=2);
    full: TASKS_FULL with FULL_DESIGN's arms and steps, lr sweep, 10 seeds, bf16 engine: scratch:4 7 arms x
    (3 lrs x 2 sweep seeds + 10 seeds) = 112 runs of 200 steps (about 9 min each two at a time on 2 CPU
    cores: about 8 h), agent 3 arms, 48 runs of 100 steps; `--tasks scratch:4` and `--tasks agent` split it.

    `tasks` runs only those tasks (same sizes) and keeps the other tasks' rows of an existing
    out_dir/algorithms.json measured with the same steps and seeds. `resume` reads back the runs an
    earlier, interrupted invocation finished in out_dir with the same settings (training_runs.finished_run):
    the full design spans several sessions of a 2-core machine, and a session's machine may be new, so
    every full run is also kept in `archive` (default results/archive/algorithms, committed; see
    bench/run_archive.py), from which `resume` reads it back on any machine."""
    explicit = tasks is not None
    if full and not quick and archive is None:
        archive = ARCHIVE / "algorithms"
    keep = {} if not explicit or quick else _previous(out_dir / "algorithms.json", full)
    tasks = tasks or (["scratch:4"] if quick else list(TASKS_FULL) if full else [TASK])
    unknown = [t for t in tasks if t not in TASKS + TASKS_FULL]
    if unknown:
        raise ValueError(f"bench algorithms: unknown task(s) {unknown}; use {TASKS + TASKS_FULL}")
    seeds = [1] if quick else FULL_SEEDS if full else [1, 2, 3, 4, 5]
    warmup = 1 if quick else WARMUP
    grid = LR_GRID if full else []      # the sweep's selection is unit-tested; quick runs stay two runs
    common = MISMATCH if full else []
    table = {k: v for k, v in keep.get("table", {}).items() if k.split("/")[0] not in tasks}
    curves = {k: v for k, v in keep.get("curves", {}).items() if k not in tasks}
    comparisons = {k: v for k, v in keep.get("comparisons", {}).items() if k not in tasks}
    task_runs = {k: v for k, v in keep.get("task_runs", {}).items() if k not in tasks}
    sweeps = {k: v for k, v in keep.get("lr_sweep", {}).items() if k.split("/")[0] not in tasks}
    failed: list[dict] = []
    reused: list[str] = []
    for task in tasks:
        started, setup = time.perf_counter(), task_setup(task, quick)
        arms, steps = design(task, quick, full)
        if archive is not None:
            restore_start(archive, setup["start"], out_dir)
        model = sft_start(out_dir, quick, recipe=setup["recipe"], overrides=tuple(setup["sft"]), name=setup["start"],
                          steps=setup.get("sft_steps"))
        if archive is not None:
            keep_start(archive, model, setup["start"])
        base = from_sft(model) + setup["rl"] + common
        work, walls = out_dir / "runs_algorithms", {}

        def specs_for(arm: str, run_seeds: list[int], lr: Optional[float], tag: str = "") -> list:
            lr_over = [f"algorithm.lr={lr:g}"] if lr is not None else []
            return [(run_name(task, arm, seed, tag), ARMS_FULL[arm] + budget_overrides(arm, steps, warmup)
                     + base + lr_over + [f"run.seed={seed}"]) for seed in run_seeds]

        chosen = {arm: None for arm in arms}
        if grid:
            sweep_seeds = SWEEP_SEEDS
            specs = [s for arm in arms for lr in grid for s in specs_for(arm, sweep_seeds, lr, _lr_tag(lr))]
            rows = run_all(specs, work, jobs=jobs, recipe=setup["recipe"], failures=failed, walls=walls,
                           resume=resume, reused=reused, archive=archive)
            for arm in arms:
                score = "heldout_acc" if setup["eval"] else "final_acc"
                per_lr = {lr: [run_metrics(rows[n])[score] for n, _ in specs_for(arm, sweep_seeds, lr, _lr_tag(lr))
                               if n in rows] for lr in grid}
                per_lr = {lr: v for lr, v in per_lr.items() if v and all(x == x for x in v)}
                if not per_lr:
                    raise RuntimeError(f"bench algorithms: no {arm} sweep run on {task} gave a score: {failed}")
                chosen[arm] = choose_lr(per_lr)
                sweeps[f"{task}/{arm}"] = {"heldout": {str(lr): statistics.fmean(v) for lr, v in per_lr.items()},
                                           "chosen": chosen[arm], "score": score, "seeds": sweep_seeds}
        specs = [s for arm in arms for s in specs_for(arm, seeds, chosen[arm])]
        rows = run_all(specs, work, jobs=jobs, recipe=setup["recipe"], failures=failed, walls=walls,
                       resume=resume, reused=reused, archive=archive)
        per_arm = {}
        for arm in arms:
            names = [n for n, _ in specs_for(arm, seeds, chosen[arm]) if n in rows]
            if not names:
                raise RuntimeError(f"bench algorithms: every {arm} run on {task} failed twice: {failed}")
            runs = [run_metrics(rows[n]) for n in names]
            per_arm[arm] = {key: [r[key] for r in runs] for key in runs[0]}
            per_arm[arm]["wall_s"] = [walls.get(n, float("nan")) for n in names]
            table[f"{task}/{arm}"] = {
                "final_acc": mean_ci(per_arm[arm]["final_acc"]), "auc_acc": mean_ci(per_arm[arm]["auc_acc"]),
                "final_reward": mean_ci(per_arm[arm]["final_reward"]), "gain": mean_ci(per_arm[arm]["gain"]),
                "heldout_acc": mean_ci(per_arm[arm]["heldout_acc"]), "per_seed": per_arm[arm],
                "seeds": [int(n.rsplit("-s", 1)[1]) for n in names], "lr": chosen[arm],
                "samples_per_run": sorted({len(rows[n]) * _batch_size(setup["recipe"], over)
                                            for n, over in specs_for(arm, seeds, chosen[arm]) if n in rows})}
            curves.setdefault(task, {})[arm] = [series(rows[n], "rollout/accuracy") for n in names]
        starts = [x for v in per_arm.values() for x in v["start_acc"]]
        table[f"{task}/sft_start"] = {"final_acc": mean_ci(starts), "runs": len(starts)}
        comparisons[task] = {f"{a}-{b}": compare(per_arm[a]["final_acc"], per_arm[b]["final_acc"])
                             for a, b in COMPARISONS if a in per_arm and b in per_arm}
        task_runs[task] = {"command": "sao bench algorithms" + (" --quick" if quick else "") + (" --full" if full else "")
                           + (f" --tasks {','.join(tasks)}" if explicit else ""), "eval": setup["eval"],
                           "recipe": str(setup["recipe"].relative_to(REPO)), "start": sft_info(model, setup["recipe"], task),
                           "wall_s": time.perf_counter() - started, "date": time.strftime("%Y-%m-%d"), "jobs": jobs,
                           "arms": arms, "steps": steps, "warmup": warmup, "runs": len(walls),
                           "samples_per_step": _batch_size(setup["recipe"], specs[0][1]),
                           "reused": len(set(walls) & set(reused)),
                           # every training run's own wall seconds (sweep included), as recorded when it ran:
                           # with runs read back from the archive, the invocation's wall_s is not the design's
                           "runs_wall_s": sum(w for w in walls.values() if w == w)}
    for task, per in curves.items():
        plot_curves(per, f"{task} from the SFT start: accuracy per step (mean +- std, {len(seeds)} seeds)",
                    out_dir / f"algorithms_{_slug(task)}.png", ylabel="accuracy")
    first = task_runs[tasks[0]]["start"]
    return {"table": table, "curves": curves, "comparisons": comparisons, "summary": _summary(table),
            "steps": design(TASK, quick, full)[1], "warmup": warmup, "seeds": seeds, "edge": EDGE, "task_runs": task_runs,
            "start": first, "samples_per_step": _batch_size(setup["recipe"], specs[0][1]), "failed_runs": failed,
            "lr_sweep": sweeps, "engine_dtype": "bf16" if common else "fp32", "reused_runs": reused,
            "archive": _shown(archive)}


def design(task: str, quick: bool, full: bool) -> tuple[list[str], int]:
    """(arms, policy steps) of a task in a variant: quick 2 arms x 2 steps, default ALGORITHMS x 100,
    full FULL_DESIGN's (every arm x FULL_STEPS for a task it does not list)."""
    if quick:
        return ["sao", "running_mean"], 2
    if full:
        planned = FULL_DESIGN.get(task, {"arms": list(ARMS_FULL), "steps": FULL_STEPS})
        return list(planned["arms"]), planned["steps"]
    return list(ALGORITHMS), 100


def run_name(task: str, arm: str, seed: int, tag: str = "") -> str:
    """A training run's name (its directory and archive entry): task, arm, the sweep's lr tag, seed."""
    return f"{_slug(task)}-{arm}{tag}-s{seed}"


def _lr_tag(lr: float) -> str:
    return f"-lr{lr:g}"


def planned_runs(task: str) -> tuple[list[str], list[str]]:
    """The names of the full design's runs on a task: its lr sweep's, then its fresh seeds'."""
    arms = design(task, quick=False, full=True)[0]
    return ([run_name(task, a, s, _lr_tag(lr)) for a in arms for lr in LR_GRID for s in SWEEP_SEEDS],
            [run_name(task, a, s) for a in arms for s in FULL_SEEDS])


def full_progress(archive: Optional[Path] = None) -> dict[str, dict[str, int]]:
    """How far the full design is: per task, its planned runs (sweep and fresh seeds) and how many of
    them the archive (default ARCHIVE/algorithms) holds at the current epoch (bench/run_archive.py)."""
    from bench.run_archive import EPOCH, entry_path, read_entry

    archive = archive or ARCHIVE / "algorithms"
    progress = {}
    for task in TASKS_FULL:
        arms = design(task, quick=False, full=True)[0]
        sweep, fresh = planned_runs(task)
        entries = {name: e for name in sweep + fresh if (e := read_entry(entry_path(archive, name))) and e["epoch"] == EPOCH}
        progress[task] = {"sweep": len(sweep), "sweep_archived": len(set(entries) & set(sweep)),
                          "fresh": len(fresh), "fresh_archived": len(set(entries) & set(fresh)),
                          "sweeps_done": _archived_sweeps(task, arms, entries)}
    return progress


def _archived_sweeps(task: str, arms: list[str], entries: dict) -> dict:
    """Per arm whose sweep the archive holds whole: mean held-out accuracy per lr and the lr choose_lr
    picks from them, as the design will (the runs are read back, so the choice is the same)."""
    done = {}
    for arm in arms:
        names = {lr: [run_name(task, arm, s, _lr_tag(lr)) for s in SWEEP_SEEDS] for lr in LR_GRID}
        if not all(n in entries for group in names.values() for n in group):
            continue
        per_lr = {lr: [heldout_accuracy([r for r in entries[n]["rows"] if r.get("step", 0) > 0]) for n in group]
                  for lr, group in names.items()}
        per_lr = {lr: v for lr, v in per_lr.items() if all(x == x for x in v)}
        if per_lr:
            done[arm] = {"heldout": {f"{lr:g}": statistics.fmean(v) for lr, v in per_lr.items()},
                         "chosen": choose_lr(per_lr)}
    return done


def _shown(path: Optional[Path]) -> Optional[str]:
    """A path as the report names it: relative to the checkout when inside it."""
    if path is None:
        return None
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _slug(task: str) -> str:
    return task.replace(":", "_")


def _summary(table: dict) -> str:
    lines = [f"{'task/algorithm':26s} {'final accuracy [95% CI]':>28s} {'AUC accuracy [95% CI]':>28s}"]
    for key, row in table.items():
        f = row["final_acc"]
        auc = row.get("auc_acc")
        lines.append(f"{key:26s} {f['mean']:8.3f} [{f['lo']:.3f}, {f['hi']:.3f}]      "
                     + (f"{auc['mean']:8.3f} [{auc['lo']:.3f}, {auc['hi']:.3f}]" if auc else "(first batch)"))
    return "\n".join(lines)


def _batch_size(recipe: Path, overrides: list[str]) -> int:
    """Samples per step a run trains on: rollout.batch_size of its recipe with its overrides (the run
    itself may have been read back from the archive, with no run directory on this machine)."""
    from checkpoints.arch import load_recipe

    return load_recipe(recipe, overrides, check_files=False).rollout.batch_size


def _previous(path: Path, full: bool) -> dict:
    """An earlier result to extend, when it was measured with the same sizes (else nothing is kept)."""
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    steps = FULL_STEPS if full else 100
    if old.get("quick") or old.get("steps") != steps or bool(old.get("full")) != full or "comparisons" not in old:
        return {}
    stale = [task for task, info in old.get("task_runs", {}).items()      # a task run at other steps or arms
             if (info.get("arms"), info.get("steps")) not in ((None, None), tuple(design(task, False, full)))]
    for key in ("table", "lr_sweep"):
        old[key] = {k: v for k, v in old.get(key, {}).items() if k.split("/")[0] not in stale}
    for key in ("curves", "comparisons", "task_runs"):
        old[key] = {k: v for k, v in old.get(key, {}).items() if k not in stale}
    return old
