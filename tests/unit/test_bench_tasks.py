"""The benchmark tasks and recipe fields of issue 30: the long-horizon scratchpad task (sparse reward,
train and held-out eval prompts disjoint), the online benchmark's per-phase AUC, and the engine dtype
that makes a real train/inference mismatch."""
from __future__ import annotations

import random

import pytest

from rollout.rewards.tasks import get_task, scratch_split


def test_the_scratchpad_task_writes_every_partial_result_and_rewards_only_the_final_answer():
    task = get_task("scratch:4")
    problem = task.make(random.Random(0))
    steps, answer = problem.label.rsplit("|", 1)
    assert len(steps.split(",")) == 4 and problem.text.endswith("=")
    assert eval(problem.text[:-1]) == int(answer)                       # the prompt's value is the answer
    assert task.score(problem.label, problem.label) == 1.0 and task.is_exact(problem.label, problem.label)
    assert task.score(f"nonsense|{answer}", problem.label) == 1.0      # the scratchpad earns nothing ...
    assert task.score(f"{steps}|{int(answer) + 1}", problem.label) == 0.0   # ... and a right one saves nothing
    assert task.score(steps, problem.label) == 0.0 and task.score("", problem.label) == 0.0
    assert task.solution(problem.label) == problem.label               # SFT learns the worked solution


def test_the_scratchpad_is_20_to_40_characters_at_four_operations():
    rng = random.Random(1)
    lengths = [len(get_task("scratch:4").make(rng).label.rsplit("|", 1)[0]) for _ in range(2000)]
    assert 20 <= min(lengths) and max(lengths) <= 40


def test_train_and_eval_prompts_are_disjoint_and_both_plentiful():
    rng = random.Random(2)
    train = {get_task("scratch:4").make(rng).text for _ in range(3000)}
    held_out = {get_task("scratch:4:eval").make(rng).text for _ in range(3000)}
    assert not train & held_out
    assert len(train) > 1000 and len(held_out) > 1000                  # thousands of problems, not a handful
    assert all(scratch_split(t[:-1]) == "train" for t in train)
    assert all(scratch_split(t[:-1]) == "eval" for t in held_out)


@pytest.mark.parametrize("name", ["scratch:2", "scratch:4:train", "scratch:x", "scratch:4:eval:1"])
def test_a_malformed_scratch_task_name_says_how_to_write_it(name):
    with pytest.raises(ValueError, match="scratch:K"):
        get_task(name)


def test_the_online_benchmark_measures_each_phase_auc_and_start_per_seed():
    from bench.online import phase_auc

    rows = [{"step": i + 1, "env/phase": p, "rollout/raw_reward": r, "train/pg_loss": 0.0}
            for i, (p, r) in enumerate(zip([0] * 4 + [1] * 4 + [2] * 2 + [0] * 3,
                                           [0.2, 0.4, 0.6, 0.8] + [0.9, 0.1, 0.1, 0.3] + [0.5, 0.5] + [0.0, 0.1, 0.2]))]
    phases = phase_auc(rows, ("digits", "capitals", "punctuation"))
    assert [p["phase"] for p in phases] == ["1:digits", "2:capitals", "3:punctuation", "4:digits"]
    assert [p["auc"] for p in phases] == pytest.approx([0.5, 0.35, 0.5, 0.1])
    # start: the phase's first steps after the left-out one (its batch may hold old-rule rewards)
    assert phases[1]["start"] == pytest.approx((0.1 + 0.1 + 0.3) / 3) and phases[3]["start"] == pytest.approx(0.15)


def test_the_engine_dtype_is_a_reference_engine_field_refused_elsewhere():
    from sao_megatron.core.config.schema import RolloutConfig

    RolloutConfig(task="chain:1:1", engine_dtype="bf16").check("rollout")
    with pytest.raises(Exception, match="engine_dtype"):
        RolloutConfig(task="chain:1:1", engine="sglang", engine_dtype="bf16").check("rollout")


def test_a_bf16_engine_is_started_with_dtype_bf16_and_weight_sync_casts_to_it(monkeypatch, tmp_path):
    import torch

    import rollout.reference_server as reference_server
    from sao_megatron.core.config.recipe import Recipe
    from sao_megatron.trainer import engines

    started = {}
    monkeypatch.setattr(reference_server, "launch_local", lambda *a, **kw: started.update(kw) or "server")
    monkeypatch.setattr(engines, "_has_indexer", lambda recipe: False)
    recipe = Recipe()
    recipe.model.path = str(tmp_path)
    assert engines.engine_weight_dtype(recipe) is None
    recipe.rollout.engine_dtype = "bf16"
    assert engines._launch_engine(recipe, 0, "key", tmp_path) == "server"
    args = started["extra_args"]
    assert args[args.index("--dtype") + 1] == "bf16"
    assert engines.engine_weight_dtype(recipe) is torch.bfloat16
