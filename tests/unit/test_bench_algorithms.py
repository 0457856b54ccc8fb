"""`sao bench algorithms --tasks T` runs only T and keeps the other tasks' rows measured at the same sizes."""
from __future__ import annotations

import json

import pytest

import bench.algorithms as algorithms


@pytest.fixture
def fake_runs(monkeypatch):
    calls = []

    def train_run(name, overrides, out_root):
        calls.append(name)
        (out_root / name).mkdir(parents=True, exist_ok=True)
        (out_root / name / "resolved_recipe.toml").write_text("[rollout]\nbatch_size = 32\n")
        return [{"step": s, "rollout/raw_reward": 0.1 * s} for s in range(1, 7)]

    monkeypatch.setattr(algorithms, "train_run", train_run)
    monkeypatch.setattr(algorithms, "plot_curves", lambda *a, **k: None)
    return calls


def test_a_task_run_alone_extends_the_previous_result(tmp_path, fake_runs):
    old = {"table": {"arithmetic/sao": {"final_mean": 0.5, "final_std": 0.1, "auc_mean": 0.3, "auc_std": 0.1,
                                        "seeds": [1, 2, 3]}},
           "curves": {"arithmetic": {"sao": [[0.5]]}}, "steps": 60, "warmup": 3, "quick": False, "full": False,
           "command": "sao bench algorithms", "wall_s": 100.0}
    (tmp_path / "algorithms.json").write_text(json.dumps(old))
    result = algorithms.run(out_dir=tmp_path, tasks=["copy"])
    assert all(name.startswith("copy-") for name in fake_runs) and len(fake_runs) == 15
    assert result["table"]["arithmetic/sao"] == old["table"]["arithmetic/sao"]
    assert {k for k in result["table"] if k.startswith("copy/")} == {f"copy/{a}" for a in algorithms.ALGORITHMS}
    assert result["task_runs"]["arithmetic"]["command"] == "sao bench algorithms"
    assert result["table"]["copy/grpo"]["samples_per_run"] == [6 * 32]    # 6 steps x batch_size each
    assert result["task_runs"]["copy"]["command"] == "sao bench algorithms --tasks copy"


def test_rows_measured_at_other_sizes_are_not_kept(tmp_path, fake_runs):
    (tmp_path / "algorithms.json").write_text(json.dumps({"table": {"arithmetic/sao": {}}, "steps": 150, "full": True}))
    result = algorithms.run(out_dir=tmp_path, tasks=["copy"])
    assert not any(k.startswith("arithmetic/") for k in result["table"])
    with pytest.raises(ValueError, match="unknown task"):
        algorithms.run(out_dir=tmp_path, tasks=["chess"])
