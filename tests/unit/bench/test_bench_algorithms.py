"""`sao bench algorithms` from the SFT start: every run starts from the one SFT model, every method
gets the same samples, intervals and differences are computed per task, and `--tasks T` keeps the
other tasks' rows measured at the same sizes."""
from __future__ import annotations

import json
import math

import pytest

import bench.algorithms as algorithms


@pytest.fixture
def fake_runs(monkeypatch, tmp_path):
    calls = {}

    def run_all(specs, out_root, jobs=1, recipe=None, timeout_s=0, failures=None, walls=None, resume=False,
                reused=None, archive=None):
        run_all.archives.append(archive)
        rows = {}
        for name, overrides in specs:
            calls[name] = overrides
            calls.setdefault("_recipes", {})[name] = recipe
            if walls is not None:
                walls[name] = 1.5
            (out_root / name).mkdir(parents=True, exist_ok=True)
            batch = 64
            (out_root / name / "resolved_recipe.toml").write_text(f"[rollout]\nbatch_size = {batch}\n")
            steps = next(int(o.split("=")[1]) for o in overrides if o.startswith("run.num_steps="))
            steps += next((int(o.split("=")[1]) for o in overrides if o.startswith("critic.warmup_steps=")), 0)
            better = 0.3 if "algorithm.name='sao'" in overrides else 0.0
            lr = next((float(o.split("=")[1]) for o in overrides if o.startswith("algorithm.lr=")), 3e-4)
            heldout = {f"eval/scratch:4:eval/avg@{algorithms.EVAL_K}": 0.5 - 100 * abs(lr - 1e-4)}   # best at 1e-4
            rows[name] = [{"step": s, "rollout/accuracy": 0.4 + better * s / steps, "rollout/raw_reward": 0.5,
                           **(heldout if s == steps else {})} for s in range(1, steps + 1)]
        return rows

    run_all.archives = []
    monkeypatch.setattr(algorithms, "run_all", run_all)
    monkeypatch.setattr(algorithms, "ARCHIVE", tmp_path / "archive")        # never the checkout's archive
    run_all.starts = []
    monkeypatch.setattr(algorithms, "restore_start", lambda archive, name, out: run_all.starts.append(("restore", name)))
    monkeypatch.setattr(algorithms, "keep_start", lambda archive, model, name: run_all.starts.append(("keep", name)))
    monkeypatch.setattr(algorithms, "sft_start", lambda out_dir, quick=False, **kw: tmp_path / "sft_model")
    monkeypatch.setattr(algorithms, "plot_curves", lambda *a, **k: None)
    return calls


def test_every_run_starts_from_the_sft_model_with_an_equal_sample_budget(tmp_path, fake_runs):
    result = algorithms.run(out_dir=tmp_path)
    fake_runs.pop("_recipes")
    assert algorithms.run_all.archives == [None] and result["archive"] is None      # the default design: none
    assert algorithms.run_all.starts == []
    assert len(fake_runs) == 5 * 5                                    # 5 algorithms x 5 seeds
    assert all(f"model.path='{tmp_path / 'sft_model'}'" in o and "sft.steps=0" in o for o in fake_runs.values())
    samples = {row["samples_per_run"][0] for key, row in result["table"].items() if "samples_per_run" in row}
    assert samples == {110 * 64}                                      # 100 policy + 10 warm-up steps, 64 each
    sao, grpo = result["table"]["chain:1:1/sao"], result["table"]["chain:1:1/grpo"]
    assert sao["final_acc"]["mean"] > grpo["final_acc"]["mean"] and sao["final_acc"]["n"] == 5
    assert result["table"]["chain:1:1/sft_start"]["runs"] == 25
    diffs = result["comparisons"]["chain:1:1"]
    assert diffs["sao-grpo"]["lo"] > 0 and diffs["sao-grpo"]["p"] < 0.05
    assert set(diffs) == {f"{a}-{b}" for a, b in algorithms.COMPARISONS if "running_mean" not in b and "clip" not in b}
    assert sao["per_seed"]["wall_s"] == [1.5] * 5 and sao["lr"] is None      # the default run sweeps nothing


def test_the_full_design_sweeps_the_lr_on_held_out_prompts_then_runs_fresh_seeds(tmp_path, fake_runs):
    result = algorithms.run(out_dir=tmp_path, full=True, tasks=["scratch:4"])
    recipes = fake_runs.pop("_recipes")
    arms = list(algorithms.ARMS_FULL)
    assert {"running_mean", "sao_ppo_clip"} <= set(arms) and len(arms) == 7
    sweep = [n for n in fake_runs if "-lr" in n]
    assert len(sweep) == len(arms) * len(algorithms.LR_GRID) * len(algorithms.SWEEP_SEEDS)
    assert all(n.rsplit("-s", 1)[1] in {str(s) for s in algorithms.SWEEP_SEEDS} for n in sweep)
    fresh = [n for n in fake_runs if "-lr" not in n]
    assert len(fresh) == len(arms) * 10 and not set(algorithms.SWEEP_SEEDS) & {int(n.rsplit("-s", 1)[1]) for n in fresh}
    for name in fresh:                                   # each arm at the lr its held-out score chose
        assert "algorithm.lr=0.0001" in fake_runs[name], name
    assert all("rollout.engine_dtype='bf16'" in o for o in fake_runs.values())       # the mismatch DIS corrects
    assert all("eval.datasets=['task:scratch:4:eval']" in o for o in fake_runs.values())
    assert all(r == algorithms.SFT_DEMO for r in recipes.values())
    assert result["lr_sweep"]["scratch:4/sao"]["chosen"] == 1e-4 and result["engine_dtype"] == "bf16"
    assert algorithms.run_all.archives == [tmp_path / "archive" / "algorithms"] * 2     # full runs are archived
    assert sorted(fake_runs) == sorted(sum(algorithms.planned_runs("scratch:4"), []))   # what the progress counts
    assert algorithms.run_all.starts == [("restore", "sft_start_scratch_4"), ("keep", "sft_start_scratch_4")]
    assert result["table"]["scratch:4/sao_ppo_clip"]["per_seed"]["heldout_acc"] == [0.5] * 10
    ppo_clip = fake_runs["scratch_4-sao_ppo_clip-s1"]
    assert "algorithm.loss='ppo'" in ppo_clip and "critic.warmup_steps=10" in ppo_clip     # same critic as SAO
    assert "run.num_steps=210" in fake_runs["scratch_4-running_mean-s1"]                   # warm-up given as steps
    from bench.report_learning import algorithms_section

    text = algorithms_section(dict(result, full=True), lambda *a: "")
    assert "scratch:4/sao: 3e-05 -> 0.493, 0.0001 -> 0.500, 0.0003 -> 0.480 (chosen 0.0001, by held-out" in text
    assert "| sao_ppo_clip |" in text and "| sao - sao_ppo_clip | 10 / 10 |" in text
    assert "held-out accuracy (task:scratch:4:eval)" in text
    # the design's other task is named as not run yet, with the archive's count, and nothing else is
    assert text.count("not yet run at full size") == 1 and "`agent` (sao, running_mean, sao_ppo_clip): not yet run" in text
    # what the design cost: every run's own wall time (sweep included), not only this invocation's
    assert result["task_runs"]["scratch:4"]["runs"] == 112 and result["task_runs"]["scratch:4"]["runs_wall_s"] == 112 * 1.5
    assert "its 112 training runs took 0.0 h, 1 at a time" in text
    # each task states its own start, steps and samples per step (the agent task's differ from scratch's)
    run = result["task_runs"]["scratch:4"]
    assert run["samples_per_step"] == algorithms._batch_size(algorithms.SFT_DEMO, []) and run["warmup"] == 10
    assert f"200 policy steps, +10 critic warm-up steps; {run['samples_per_step']} samples per step;" in text


def test_a_design_read_back_from_the_archive_states_its_runs_wall_time_without_a_concurrency_it_did_not_record():
    from bench.report_learning import _task_wall

    run = {"wall_s": 2.0, "runs_wall_s": 7200.0, "runs": 48, "jobs": 1}
    assert _task_wall(dict(run, reused=0)).endswith("its 48 training runs took 2.0 h, 1 at a time)")
    assert _task_wall(dict(run, reused=48)).endswith("took 2.0 h, as recorded when each ran)")
    assert _task_wall(dict(run, reused=40)).endswith("as recorded when each ran; 40 of them read back)")


def test_the_agent_task_runs_on_the_agent_recipe_from_its_own_sft_start(tmp_path, fake_runs, monkeypatch):
    starts = []
    monkeypatch.setattr(algorithms, "sft_start", lambda out_dir, quick=False, **kw: starts.append(kw) or tmp_path)
    result = algorithms.run(out_dir=tmp_path, full=True, tasks=["agent"])
    recipes = fake_runs.pop("_recipes")
    assert set(recipes.values()) == {algorithms.AGENT_RECIPE}
    assert starts[0]["recipe"] == algorithms.AGENT_RECIPE and starts[0]["name"] == "sft_start_agent"
    # the agent's own episodes on held-out problems choose the lr
    assert all("eval.datasets=['tool_task:chain:1:1:eval']" in o for o in fake_runs.values())
    assert result["lr_sweep"]["agent/sao"]["score"] == "heldout_acc"
    # SAO and both ablation arms, 10 fresh seeds each, at half the scratch task's steps
    arms = {name.split("-")[1] for name in fake_runs}
    assert arms == {"sao", "running_mean", "sao_ppo_clip"} == set(result["task_runs"]["agent"]["arms"])
    assert len([n for n in fake_runs if "-lr" not in n]) == 3 * 10
    assert "run.num_steps=100" in fake_runs["agent-sao-s1"] and "run.num_steps=110" in fake_runs["agent-running_mean-s1"]
    assert result["task_runs"]["agent"]["steps"] == 100 and result["steps"] == algorithms.FULL_STEPS
    assert set(result["comparisons"]["agent"]) == {"sao-sao_ppo_clip", "sao-running_mean"}
    from bench.report_claims import _algorithm_rows
    from bench.report_learning import algorithms_section

    text = algorithms_section(dict(result, full=True), lambda *a: "")
    samples = result["task_runs"]["agent"]["samples_per_step"]
    assert samples == algorithms._batch_size(algorithms.AGENT_RECIPE, [])
    assert (f"100 policy steps, +10 critic warm-up steps; {samples} samples per step; the design's arms on this "
            "task: sao, running_mean, sao_ppo_clip)") in text
    rows = _algorithm_rows(dict(result, full=True))   # claims against arms --full does not run here are not rows
    assert rows and not any("not yet run" in row["measured"] for row in rows)


def test_a_kept_task_measured_at_other_steps_or_arms_is_dropped_not_mixed_in(tmp_path, fake_runs):
    first = algorithms.run(out_dir=tmp_path, full=True, tasks=["agent"])
    first["task_runs"]["agent"]["steps"] = 200              # as a file from before FULL_DESIGN would say
    (tmp_path / "algorithms.json").write_text(json.dumps(dict(first, quick=False, full=True)))
    result = algorithms.run(out_dir=tmp_path, full=True, tasks=["scratch:4"])
    assert not any(key.startswith("agent/") for key in result["table"]) and "agent" not in result["comparisons"]
    first["task_runs"]["agent"]["steps"] = 100
    (tmp_path / "algorithms.json").write_text(json.dumps(dict(first, quick=False, full=True)))
    result = algorithms.run(out_dir=tmp_path, full=True, tasks=["scratch:4"])
    assert result["table"]["agent/sao"] == first["table"]["agent/sao"]


def test_the_scratch_task_starts_from_a_longer_sft_than_the_demos(tmp_path, fake_runs, monkeypatch):
    """scratch:4 after the demo's 200 SFT steps is near the floor (held-out 0.13): nothing for RL to build on."""
    starts = []
    monkeypatch.setattr(algorithms, "sft_start", lambda out_dir, quick=False, **kw: starts.append(kw) or tmp_path)
    algorithms.run(out_dir=tmp_path, full=True, tasks=["scratch:4"])
    assert starts[0]["steps"] == algorithms.SCRATCH_SFT_STEPS == 400 and starts[0]["name"] == "sft_start_scratch_4"
    algorithms.run(out_dir=tmp_path, full=True, tasks=["agent"])
    assert starts[1]["steps"] is None          # the agent recipe's own sft.steps


def test_sft_start_makes_the_start_with_the_steps_asked_for(tmp_path, monkeypatch):
    from bench import sft_start as module

    calls = []

    def fake_run(cmd, cwd, **kw):
        calls.append(cmd)
        model = tmp_path / "s" / "model"
        model.mkdir(parents=True, exist_ok=True)
        (model / "config.json").write_text("{}")
        steps = int(next(c for c in cmd if c.startswith("sft.steps=")).split("=")[1])
        (model / "sao_sft.json").write_text(json.dumps({"sft": {"steps": steps}}))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    module.sft_start(tmp_path, name="s", steps=400)
    module.sft_start(tmp_path, name="s", steps=400)      # its marker matches: made once
    module.sft_start(tmp_path, name="s")                 # the recipe's 200 steps: made again
    assert [c[-1] for c in calls] == ["sft.steps=400", "sft.steps=200"]


def test_the_lr_with_the_best_mean_score_wins_and_ties_go_to_the_smaller():
    assert algorithms.choose_lr({1e-4: [0.25, 0.75], 3e-4: [0.5, 0.5], 1e-3: [0.1, 0.1]}) == 1e-4   # a tie
    assert algorithms.choose_lr({1e-4: [0.2], 3e-4: [0.5], 1e-3: [0.45]}) == 3e-4


def test_a_task_run_alone_extends_the_previous_result(tmp_path, fake_runs):
    first = algorithms.run(out_dir=tmp_path)
    (tmp_path / "algorithms.json").write_text(json.dumps(dict(first, quick=False, full=False)))
    fake_runs.clear()
    result = algorithms.run(out_dir=tmp_path, tasks=["chain:2:1"])
    fake_runs.pop("_recipes")
    assert fake_runs and all(name.startswith("chain_2_1-") for name in fake_runs)
    assert result["table"]["chain:1:1/sao"] == first["table"]["chain:1:1/sao"]
    assert set(result["comparisons"]) == {"chain:1:1", "chain:2:1"}
    assert result["task_runs"]["chain:2:1"]["command"] == "sao bench algorithms --tasks chain:2:1"
    with pytest.raises(ValueError, match="unknown task"):
        algorithms.run(out_dir=tmp_path, tasks=["chess"])


def test_a_failed_run_is_run_again_and_one_failing_twice_is_left_out_and_named(tmp_path, monkeypatch):
    import bench.training_runs as training_runs
    from bench.report_learning import failures_text

    tries = {}

    def train_run(name, overrides, out_root, timeout_s, recipe):
        tries[name] = tries.get(name, 0) + 1
        if name == "flaky" and tries[name] == 1 or name == "broken":
            raise RuntimeError(f"training run {name} failed (exit 1); log {name}.log:\ncontrol call failed")
        return [{"step": 1}]

    monkeypatch.setattr(training_runs, "train_run", train_run)
    failed = []
    rows = training_runs.run_all([("first", []), ("flaky", []), ("broken", [])], tmp_path, jobs=2, failures=failed)
    assert set(rows) == {"first", "flaky"} and tries == {"first": 1, "flaky": 2, "broken": 2}
    assert [(f["run"], f["kept"], len(f["errors"])) for f in failed] == [("flaky", True, 1), ("broken", False, 2)]
    assert failed[1]["errors"][0] == "training run broken failed (exit 1); log broken.log: control call failed"
    text = failures_text({"failed_runs": failed})
    assert "run again from scratch and kept: flaky" in text and "left out of every number above: broken" in text
    with pytest.raises(RuntimeError, match="broken failed twice"):
        training_runs.run_all([("first", []), ("broken", [])], tmp_path)      # no failures list: it raises


def _finished(out_root, name, settings: dict, done: bool = True, wall: float | None = 12.5):
    """A run directory as `sao train` leaves it: log, metrics, resolved recipe (and the bench's wall file)."""
    run_dir = out_root / name
    run_dir.mkdir(parents=True)
    (out_root / f"{name}.log").write_text("warming up\n" + (f"done: 2 steps, weight version 2; run dir {run_dir}\n"
                                                            if done else "Traceback (most recent call last):\n"))
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n')
    lines = []
    for section, values in settings.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    (run_dir / "resolved_recipe.toml").write_text("\n".join(lines) + "\n")
    if wall is not None:
        (run_dir / "bench_wall_s.json").write_text(json.dumps({"wall_s": wall}))


def test_resume_reads_back_only_runs_finished_with_the_same_settings(tmp_path, monkeypatch):
    """--resume: a run an interrupted invocation finished with these overrides is read back (its wall time
    the recorded one); a different setting, an unfinished log or no resume runs it again."""
    import bench.training_runs as training_runs

    out = tmp_path.resolve()
    common = {"logging": {"wandb": False, "console": False, "plot": False},
              "checkpoint": {"interval": 0, "resume": "never"}}

    def settings(name, lr):
        return {"run": {"name": name, "output_dir": str(out), "seed": 1}, "algorithm": {"lr": lr},
                "model": {"path": "/sft/model"}, **common}

    overrides = ["model.path='/sft/model'", "algorithm.lr=0.0003", "run.seed=1"]
    _finished(out, "same", settings("same", 3e-4))
    _finished(out, "old_lr", settings("old_lr", 1e-4))
    _finished(out, "crashed", settings("crashed", 3e-4), done=False)
    _finished(out, "no_wall", settings("no_wall", 3e-4), wall=None)
    ran = []

    def train_run(name, overrides, out_root, timeout_s, recipe):
        ran.append(name)
        return [{"step": 1, "x": 9}]

    monkeypatch.setattr(training_runs, "train_run", train_run)
    specs = [(n, overrides) for n in ("same", "old_lr", "crashed", "no_wall")]
    walls, reused = {}, []
    rows = training_runs.run_all(specs, out, resume=True, walls=walls, reused=reused)
    assert sorted(ran) == ["crashed", "old_lr"] and sorted(reused) == ["no_wall", "same"]
    assert rows["same"] == [{"step": 1, "x": 1}, {"step": 2, "x": 2}] and rows["old_lr"] == [{"step": 1, "x": 9}]
    assert walls["same"] == 12.5 and math.isnan(walls["no_wall"])
    ran.clear()
    training_runs.run_all(specs, out)                                   # without resume every run runs
    assert sorted(ran) == ["crashed", "no_wall", "old_lr", "same"]


def test_the_report_says_how_many_runs_were_read_back():
    from bench.report_learning import failures_text

    assert failures_text({"failed_runs": [], "reused_runs": []}) == ""
    text = failures_text({"failed_runs": [], "reused_runs": ["a", "b"]})
    assert text.startswith("2 training run(s) were read back from an earlier, interrupted invocation")
    text = failures_text({"failed_runs": [], "reused_runs": ["a"], "archive": "results/archive/algorithms"})
    assert "the run archive `results/archive/algorithms`" in text
