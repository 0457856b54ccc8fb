"""Built-in task generators and checkers, and the changing environment."""
from __future__ import annotations

import random

import pytest

from rollout.rewards.environments import ChangingEnvironment
from rollout.rewards.task_reward import task_reward
from rollout.rewards.tasks import (get_task, make_arithmetic, make_copy, make_countdown, score_arithmetic,
                                   score_copy, score_countdown, _eval_arith)
from sao_megatron.core.records import Sample


def test_arithmetic_problems_have_single_digit_answers_that_check():
    rng = random.Random(0)
    for _ in range(200):
        p = make_arithmetic(rng)
        assert len(p.label) == 1 and _eval_arith(p.text.rstrip("=")) == int(p.label)
        assert score_arithmetic(p.label, p.label) == 1.0


@pytest.mark.parametrize("response,score", [("7", 1.0), (" 7 ", 1.0), ("72", 0.5), ("3", 0.1), ("x7", 0.0), ("", 0.0)])
def test_arithmetic_partial_credit(response, score):
    assert score_arithmetic(response, "7") == score


def test_countdown_generated_problems_are_solvable_and_scored():
    rng = random.Random(1)
    for _ in range(100):
        p = make_countdown(rng)
        nums = p.label["numbers"]
        assert len(nums) == 3 and all(1 <= n <= 9 for n in nums)
    label = {"numbers": [2, 3, 4], "target": 14}
    assert score_countdown("2+3*4", label) == 1.0
    assert score_countdown("(4-2)*3", label) == 0.1          # valid, wrong value
    assert score_countdown("3*4+2=14", label) == 1.0
    assert score_countdown("5*3-1", label) == 0.0             # numbers not offered
    assert score_countdown("2*2*3", label) == 0.0             # 2 used twice
    assert score_countdown("__import__('os')", label) == 0.0  # not arithmetic
    assert score_countdown("2**30", label) == 0.0             # power is not allowed


def test_copy_reverse_scores_by_position():
    assert make_copy(random.Random(0)).text.startswith("reverse ")
    assert score_copy("cba", "cba") == 1.0
    assert score_copy("cbx", "cba") == pytest.approx(2 / 3)
    assert score_copy("cbaaa", "cba") == pytest.approx(3 / 5)
    assert score_copy("", "cba") == 0.0


def test_digits_task_scores_the_fraction_of_digits():
    task = get_task("digits")
    problem = task.make(random.Random(0))
    assert problem.text.endswith(":") and len(problem.text) == 2 and problem.text[0].islower()
    assert task.score(" 123 ", problem.label) == 1.0
    assert task.score("1a2b", problem.label) == 0.5
    assert task.score("", problem.label) == 0.0 and task.score("abc", problem.label) == 0.0


def test_environment_switches_on_schedule():
    env = ChangingEnvironment(switch_every=3, rules=("upper", "double", "next"))
    assert [env.phase(s) for s in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 0]
    assert [env.target("z", s) for s in (0, 3, 6)] == ["Z", "zz", "a"]
    assert env.score("Z", "z", 0) == 1.0 and env.score("Z", "z", 3) == 0.0 and env.score("zz!", "z", 4) == 0.5


def test_online_task_reward_reads_the_step_stamped_by_the_driver():
    meta = {"task": "online", "switch_every": 2, "rules": ["upper", "double"]}
    s = Sample(uid="p0", prompt_index=0, prompt_ids=[1], label="q", response_text="QQ", metadata=dict(meta, env_step=0))
    assert task_reward(s) == {"reward": 0.5, "env_phase": 0}
    s.metadata["env_step"] = 2
    assert task_reward(s) == {"reward": 0.0, "env_phase": 1}
    s.response_text = "qq"
    assert task_reward(s)["reward"] == 1.0


def test_environment_rejects_bad_settings():
    with pytest.raises(ValueError, match="switch_every=0"):
        ChangingEnvironment(switch_every=0)
    with pytest.raises(ValueError, match="unknown rules"):
        ChangingEnvironment(rules=("upper", "sideways"))
