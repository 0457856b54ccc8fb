"""The benchmark tasks and recipe fields of issue 30: the long-horizon scratchpad task (sparse reward,
train and held-out eval prompts disjoint), the online benchmark's per-phase AUC, and the engine dtype
that makes a real train/inference mismatch."""
from __future__ import annotations

import random

import pytest

from rollout.rewards.tasks import get_task, heldout_split


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
    assert all(heldout_split(t[:-1]) == "train" for t in train)
    assert all(heldout_split(t[:-1]) == "eval" for t in held_out)


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

    import rollout.engines.reference_server as reference_server
    from sao_megatron.core.config.recipe import Recipe
    from sao_megatron.trainer import engines

    started = {}
    monkeypatch.setattr(reference_server, "launch_local", lambda *a, **kw: started.update(kw) or "server")
    recipe = Recipe()
    recipe.model.path = str(tmp_path)
    assert engines.engine_weight_dtype(recipe) is None
    recipe.rollout.engine_dtype = "bf16"
    assert engines.launch_engine(recipe, 0, "key", tmp_path) == "server"
    args = started["extra_args"]
    assert args[args.index("--dtype") + 1] == "bf16"
    assert engines.engine_weight_dtype(recipe) is torch.bfloat16


def test_the_online_report_compares_auc_after_the_first_phase_per_seed_and_counts_reachable_phases():
    from bench.online import REACHABLE, _auc_row
    from bench.report_learning import phase_auc_text

    def runs(shift):    # 5 seeds x 3 phases; later phases' AUC rise with the seed index
        return [[{"phase": "1:digits", "auc": 0.9, "start": 0.1},
                 {"phase": "2:capitals", "auc": 0.2 + shift + 0.01 * i, "start": 0.01 if i == 0 else 0.1},
                 {"phase": "3:punctuation", "auc": 0.4 + shift + 0.01 * i, "start": 0.2}] for i in range(5)]

    sao, base = _auc_row(runs(0.3)), _auc_row(runs(0.0))
    assert sao["auc_per_seed"] == pytest.approx([0.6 + 0.01 * i for i in range(5)])   # mean of phases 2 and 3
    assert sao["reachable"] == {"1:digits": 5, "2:capitals": 4, "3:punctuation": 5}    # seed 0 started at 0.01
    text = phase_auc_text({"sao": sao, "running_mean": base}, REACHABLE)
    assert "| sao: reachable at its start (level >= 0.05), seeds | 5 of 5 | 4 of 5 | 5 of 5 |  |" in text
    # unpaired seeds: each group's variance 0.00025, se = 0.01, Welch df 8, t(0.975, 8) = 2.306; the groups
    # do not overlap, so 2 of the C(10, 5) = 252 relabelings are as extreme: p = 0.008
    assert "| sao - running_mean | 5 / 5 | 0.300 [0.277, 0.323] | 0.000 | 0.008 (exact, 252) |" in text
    assert "| first higher |" in text


def test_the_full_online_variant_runs_four_phases_of_the_drift_rules_back_to_the_first():
    from bench.online import run_specs, variant
    from rollout.rewards.environments import DEFAULT_RULES, DRIFT_RULES, ChangingEnvironment
    from sao_megatron.core.config.recipe import parse_override

    specs = run_specs(variant(full=True), [])
    assert len(specs) == 30                                     # 3 methods x 10 seeds
    overrides = dict(parse_override(o) for o in specs[0][1])
    env = ChangingEnvironment(overrides["rollout.env_switch_every"], tuple(overrides["rollout.env_rules"]))
    phases = [env.rule(k * env.switch_every) for k in range(overrides["run.num_steps"] // env.switch_every)]
    assert phases == ["drift_digits", "drift_capitals", "drift_punctuation", "drift_digits"] == [*DRIFT_RULES,
                                                                                                 DRIFT_RULES[0]]
    default = dict(parse_override(o) for o in run_specs(variant(), [])[0][1])
    assert default["rollout.env_rules"] == list(DEFAULT_RULES)
