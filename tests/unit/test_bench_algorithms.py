"""`sao bench algorithms` from the SFT start: every run starts from the one SFT model, every method
gets the same samples, intervals and differences are computed per task, and `--tasks T` keeps the
other tasks' rows measured at the same sizes."""
from __future__ import annotations

import json

import pytest

import bench.algorithms as algorithms


@pytest.fixture
def fake_runs(monkeypatch, tmp_path):
    calls = {}

    def run_all(specs, out_root, jobs=1, recipe=None, timeout_s=0, failures=None):
        rows = {}
        for name, overrides in specs:
            calls[name] = overrides
            (out_root / name).mkdir(parents=True, exist_ok=True)
            batch = 64
            (out_root / name / "resolved_recipe.toml").write_text(f"[rollout]\nbatch_size = {batch}\n")
            steps = next(int(o.split("=")[1]) for o in overrides if o.startswith("run.num_steps="))
            steps += next((int(o.split("=")[1]) for o in overrides if o.startswith("critic.warmup_steps=")), 0)
            better = 0.3 if "algorithm.name='sao'" in overrides else 0.0
            rows[name] = [{"step": s, "rollout/accuracy": 0.4 + better * s / steps, "rollout/raw_reward": 0.5}
                          for s in range(1, steps + 1)]
        return rows

    monkeypatch.setattr(algorithms, "run_all", run_all)
    monkeypatch.setattr(algorithms, "sft_start", lambda out_dir, quick=False: tmp_path / "sft_model")
    monkeypatch.setattr(algorithms, "plot_curves", lambda *a, **k: None)
    return calls


def test_every_run_starts_from_the_sft_model_with_an_equal_sample_budget(tmp_path, fake_runs):
    result = algorithms.run(out_dir=tmp_path)
    assert len(fake_runs) == 5 * 5                                    # 5 algorithms x 5 seeds
    assert all(f"model.path='{tmp_path / 'sft_model'}'" in o and "sft.steps=0" in o for o in fake_runs.values())
    samples = {row["samples_per_run"][0] for key, row in result["table"].items() if "samples_per_run" in row}
    assert samples == {110 * 64}                                      # 100 policy + 10 warm-up steps, 64 each
    sao, grpo = result["table"]["chain:1:1/sao"], result["table"]["chain:1:1/grpo"]
    assert sao["final_acc"]["mean"] > grpo["final_acc"]["mean"] and sao["final_acc"]["n"] == 5
    assert result["table"]["chain:1:1/sft_start"]["runs"] == 25
    diffs = result["comparisons"]["chain:1:1"]
    assert diffs["sao-grpo"]["lo"] > 0 and set(diffs) == {f"{a}-{b}" for a, b in algorithms.COMPARISONS}


def test_a_task_run_alone_extends_the_previous_result(tmp_path, fake_runs):
    first = algorithms.run(out_dir=tmp_path)
    (tmp_path / "algorithms.json").write_text(json.dumps(dict(first, quick=False, full=False)))
    fake_runs.clear()
    result = algorithms.run(out_dir=tmp_path, tasks=["chain:2:1"])
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
    text = failures_text({"failed_runs": failed})
    assert "run again from scratch and kept: flaky" in text and "left out of every number above: broken" in text
    with pytest.raises(RuntimeError, match="broken failed twice"):
        training_runs.run_all([("first", []), ("broken", [])], tmp_path)      # no failures list: it raises
