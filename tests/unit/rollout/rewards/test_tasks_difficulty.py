"""The chain task family (rollout/rewards/tasks.py): a difficulty knob (operations, digits), graded
rewards with an exact-answer flag, and the rollout/accuracy metric built on that flag."""
from __future__ import annotations

import random
import re

import pytest

from rollout.rewards.task_reward import task_reward
from rollout.rewards.tasks import get_task, heldout_split, score_chain
from sao_megatron.core.records import Sample
from sao_megatron.metrics.learning import accuracy


def _problems(name: str, n: int = 200):
    task, rng = get_task(name), random.Random(3)
    return task, [task.make(rng) for _ in range(n)]


@pytest.mark.parametrize("name,ops,digits", [("chain", 1, 1), ("chain:2:1", 2, 1), ("chain:3:2", 3, 2)])
def test_chain_answers_are_the_value_of_the_expression(name, ops, digits):
    _, problems = _problems(name)
    for p in problems:
        expr = p.text.rstrip("=")
        numbers = re.findall(r"\d+", expr)
        assert len(numbers) == ops + 1 and all(len(n) <= digits for n in numbers)
        assert int(p.label) == eval(expr)       # test-only: the generator's own digits and + / -
        running = int(numbers[0])               # no partial result goes negative
        for op, n in re.findall(r"([+-])(\d+)", expr):
            running += int(n) if op == "+" else -int(n)
            assert running >= 0
        assert p.metadata["task"] == f"chain:{ops}:{digits}"


def test_difficulty_lengthens_answers_and_prompts():
    easy = _problems("chain:1:1")[1]
    hard = _problems("chain:4:3")[1]
    mean = lambda xs: sum(xs) / len(xs)
    assert mean([len(p.label) for p in hard]) > mean([len(p.label) for p in easy]) + 1.5
    assert mean([len(p.text) for p in hard]) > 2 * mean([len(p.text) for p in easy])


def test_chain_scores_are_graded_and_exact_is_strict():
    assert score_chain(" 42 ", "42") == 1.0
    assert score_chain("43", "42") == 0.25          # one of two digits at its place
    assert score_chain("4", "42") == 0.25           # shorter answer: same / max length
    assert score_chain("x42", "42") == 0.0          # not a number: no credit
    task = get_task("chain:1:2")
    assert task.is_exact("42", "42") and not task.is_exact("43", "42") and not task.is_exact("42.", "42")
    assert task.solution("42") == "42"


def test_task_reward_reports_correct_and_accuracy_counts_it():
    def sample(text, label="12", task="chain:1:1"):
        return Sample(uid=text, prompt_index=0, prompt_ids=[1], response_text=text, label=label,
                      metadata={"task": task})

    graded = [sample("12"), sample("13"), sample("x"), sample(" 12")]
    for s in graded:
        info = task_reward(s)
        s.reward, s.reward_info = info["reward"], info
    assert [s.reward_info["correct"] for s in graded] == [1.0, 0.0, 0.0, 1.0]
    assert graded[1].reward == 0.25                 # graded credit, but not correct
    assert accuracy(graded) == 0.5
    # arithmetic's 0.5 for "right digit, trailing text" is not an exact answer
    info = task_reward(sample("3x", label="3", task="arithmetic"))
    assert info["reward"] == 0.5 and info["correct"] == 0.0


def test_accuracy_without_a_correct_flag_uses_full_reward():
    samples = [Sample(uid=str(i), prompt_index=i, prompt_ids=[1], reward=r) for i, r in enumerate([1.0, 0.9, 0.0, 1.0])]
    assert accuracy(samples) == 0.5


@pytest.mark.parametrize("level", ["1:1", "2:1"])
def test_a_chain_split_draws_only_its_side_and_the_plain_name_both(level):
    def texts(name):
        task, rng = get_task(name), random.Random(5)
        return {task.make(rng).text for _ in range(3000)}

    train, held_out, both = texts(f"chain:{level}:train"), texts(f"chain:{level}:eval"), texts(f"chain:{level}")
    assert held_out and not train & held_out                            # an eval never sees a training prompt
    assert {heldout_split(t[:-1]) for t in train} == {"train"} and {heldout_split(t[:-1]) for t in held_out} == {"eval"}
    assert {heldout_split(t[:-1]) for t in both} == {"train", "eval"}
    assert len(held_out) < len(train)                                    # one problem in EVAL_SHARE is held out
    problem = get_task(f"chain:{level}:eval").make(random.Random(0))
    assert int(problem.label) == eval(problem.text[:-1]) and problem.metadata["split"] == "eval"
    assert get_task(problem.metadata["task"]).score(problem.label, problem.label) == 1.0   # the reward resolves it


def test_chain_without_a_split_draws_what_it_always_drew():
    rng = random.Random(7)            # the demo task's prompts (and every published run) stay the same
    assert [get_task("chain:1:1").make(rng).text for _ in range(5)] == ["5+6=", "0+1=", "8-0=", "8-1=", "6-1="]


@pytest.mark.parametrize("name,fix", [("chain:0:1", "1..8"), ("chain:2:9", "1..6"), ("chain:x", "chain:K:D"),
                                      ("chains", "chain:K:D"), ("chain:1:1:test", "chain:K:D[:train|:eval]")])
def test_bad_chain_names_say_how_to_write_one(name, fix):
    with pytest.raises(ValueError, match="rollout.task") as err:
        get_task(name)
    assert fix in str(err.value)
