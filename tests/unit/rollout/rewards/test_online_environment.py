"""The online task's default style rules: the rewarded character class changes with the phase."""
from __future__ import annotations

import pytest

from rollout.rewards.environments import DEFAULT_RULES, ChangingEnvironment
from rollout.rewards.task_reward import task_reward
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
