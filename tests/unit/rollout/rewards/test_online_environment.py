"""The online task's rules: the default style rules and the overlapping drift rules."""
from __future__ import annotations

import itertools
import statistics

import pytest

from checkpoints.init_model import build_tokenizer
from rollout.prompts import build_prompt_source
from rollout.rewards.environments import (DEFAULT_RULES, DRIFT_CLASSES, DRIFT_LENGTH, DRIFT_RULES,
                                          ChangingEnvironment)
from rollout.rewards.task_reward import task_reward
from sao_megatron.core.config.schema import RolloutConfig
from sao_megatron.core.records import Sample


def test_default_rules_are_styles_that_switch_on_schedule():
    env = ChangingEnvironment(switch_every=2)
    assert env.rules == DEFAULT_RULES == ("digits", "capitals", "punctuation")
    assert [env.rule(s) for s in range(7)] == ["digits"] * 2 + ["capitals"] * 2 + ["punctuation"] * 2 + ["digits"]


@pytest.mark.parametrize("response, step, score", [
    ("1234", 0, 1.0), (" 12ab ", 0, 0.5), ("abcd", 0, 0.0), ("", 0, 0.0), ("   ", 0, 0.0),
    ("ABC", 1, 1.0), ("AbC1", 1, 0.5), ("!?.,", 2, 1.0), ("!a", 2, 0.5), ("٣", 0, 0.0),  # non-ASCII digit
])
def test_style_score_is_the_fraction_of_characters_in_the_class(response, step, score):
    env = ChangingEnvironment(switch_every=1)
    assert env.score(response, "q", step) == pytest.approx(score)


def test_style_reward_ignores_the_letter_and_follows_the_stamped_step():
    meta = {"task": "online", "switch_every": 3, "rules": list(DEFAULT_RULES)}
    s = Sample(uid="p0", prompt_index=0, prompt_ids=[1], label="q", response_text="42", metadata=dict(meta, env_step=0))
    assert task_reward(s) == {"reward": 1.0, "env_phase": 0}
    s.metadata["env_step"] = 3
    assert task_reward(s) == {"reward": 0.0, "env_phase": 1}


def test_letter_rules_and_style_rules_mix():
    env = ChangingEnvironment(switch_every=1, rules=("upper", "digits"))
    assert env.score("Q", "q", 0) == 1.0 and env.score("7", "q", 1) == 1.0 and env.score("Q", "q", 1) == 0.0


@pytest.mark.parametrize("response, step, score", [
    ("01234567", 0, 1.0), (" 98765432 ", 0, 1.0), ("0000", 0, 1 / 8), ("0123", 0, 4 / 8), ("0123456789", 0, 1.0),
    ("0123456789ab", 0, 10 / 12), ("ABCD", 0, 0.0), ("", 0, 0.0),
    ("9ABCDEFG", 1, 1.0), ("12345678", 1, 1 / 8), ("90000000", 1, 1 / 8), ("!#$%&*+?", 1, 0.0),
    ("!#$%&*+?", 2, 1.0), ("IJ01", 2, 4 / 8), ("ABCDEFGH", 2, 0.0), ("IJIJIJIJ", 2, 2 / 8), ("3456789K", 2, 0.0),
])
def test_drift_rules_score_distinct_class_characters_over_the_length(response, step, score):
    env = ChangingEnvironment(switch_every=1, rules=DRIFT_RULES)
    assert env.score(response, "q", step) == pytest.approx(score)


def test_drift_cycle_returns_to_the_first_rule_at_phase_four():
    env = ChangingEnvironment(switch_every=40, rules=DRIFT_RULES)
    assert [env.rule(40 * k) for k in range(4)] == ["drift_digits", "drift_capitals", "drift_punctuation",
                                                      "drift_digits"]


def test_each_drift_class_shares_characters_with_its_neighbours_only():
    d, c, p = (set(DRIFT_CLASSES[r]) for r in DRIFT_RULES)
    assert (d & c, c & p, p & d) == ({"8", "9"}, {"I", "J"}, {"0", "1", "2"})
    assert d == set("0123456789") and (len(c), len(p)) == (12, 16) and not d & c & p


@pytest.mark.parametrize("old, new", [(0, 1), (1, 2), (2, 0)])
def test_a_policy_that_learned_a_phase_starts_the_next_within_reach(old, new):
    """A policy at 1.0 on the old rule answers DRIFT_LENGTH distinct characters of its class; over every
    such answer, the next rule's mean score lies in the 5-20% the online bench asks of a phase start."""
    env = ChangingEnvironment(switch_every=1, rules=DRIFT_RULES)
    answers = ["".join(a) for a in itertools.combinations(DRIFT_CLASSES[DRIFT_RULES[old]], DRIFT_LENGTH)]
    assert all(env.score(a, "q", old) == 1.0 for a in answers)
    start = statistics.fmean(env.score(a, "q", new) for a in answers)
    assert 0.05 <= start <= 0.20 + 1e-12, start


def test_unknown_rule_names_are_refused_in_one_line_naming_the_field():
    with pytest.raises(ValueError) as err:
        ChangingEnvironment(rules=("drift_digits", "drift_colours"))
    message = str(err.value)
    assert "\n" not in message and message.startswith("rollout.env_rules: unknown rules ['drift_colours']")
    assert "drift_capitals" in message


def test_the_recipe_field_selects_the_rule_cycle():
    tok = build_tokenizer()
    src = build_prompt_source(RolloutConfig(task="online", env_rules=list(DRIFT_RULES)), tok, seed=0, num_problems=2)
    assert src.next().metadata["rules"] == list(DRIFT_RULES)
    default = build_prompt_source(RolloutConfig(task="online"), tok, seed=0, num_problems=2)
    assert default.next().metadata["rules"] == list(DEFAULT_RULES)
