"""Agentic training from a recipe: rollout.agent and rollout.generate_fn reach the driver (issue 28.4).

The engine is scripted (rollout/engines/scripted.py): each turn writes the next tool call of a fixed
episode, so what is tested is the wiring recipe -> agent -> driver -> metrics, with the python tool
run for real (without bubblewrap: rollout.sandbox = unsafe-no-isolation, as where bwrap is missing).
"""
from __future__ import annotations

import asyncio
import json

import pytest

from checkpoints.init_model import build_tokenizer
from rollout.agents.tool_loop import FunctionAgent, ToolAgent, append_observation
from rollout.driver import RolloutDriver
from rollout.prompts import build_prompt_source
from rollout.rewards.tasks import heldout_split
from rollout.engines.scripted import ScriptedEngine
from sao_megatron.core.config import ConfigError, load_recipe
from sao_megatron.core.config.schema import AGENTS as AGENT_NAMES
from sao_megatron.core.records import SampleStatus
from sao_megatron.evaluation.agents import AGENTS, build_rollout_plugins

TOK = build_tokenizer()
SMALL = ["rollout.sandbox=unsafe-no-isolation", "rollout.batch_size=4", "rollout.max_in_flight=4"]


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def episode(turns):
    """The n-th turn (n = tool responses in the context so far) writes turns[n]."""
    def script(input_ids):
        n = TOK.decode(input_ids, skip_special_tokens=False).count("<tool_response>")
        return TOK.encode(turns[min(n, len(turns) - 1)], add_special_tokens=False)
    return script


async def one_batch(recipe, script, n=4):
    agent, reward_fn = build_rollout_plugins(recipe.rollout, TOK, recipe.model.max_seq_len)
    source = build_prompt_source(recipe.rollout, TOK, seed=0, num_problems=32)
    engine = ScriptedEngine("e0", script=script)
    driver = RolloutDriver([engine], source, reward_fn, recipe.rollout, TOK, seed=0, agent=agent,
                           context_length=recipe.model.max_seq_len)
    await driver.start()
    try:
        batch = await driver.get_batch(n, 0)
        return agent, batch, driver.metrics()
    finally:
        await driver.stop()


def test_tiny_agent_recipe_runs_multi_turn_episodes_with_masked_tool_output():
    recipe = load_recipe("recipes/tiny_agent_cpu.toml", SMALL, check_files=False)
    script = episode([call("python", code="print(1+1)"), call("submit", answer="2")])
    agent, batch, metrics = asyncio.run(one_batch(recipe, script))
    assert isinstance(agent, ToolAgent) and agent.max_turns == recipe.rollout.max_turns
    assert metrics["rollout/turns"] == 2.0                    # python, then submit
    for s in batch:
        s.check()
        assert s.status == SampleStatus.COMPLETED and s.metadata["submitted"] == "2"
        observation = TOK.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0])
        assert "2" in observation and 0 in s.loss_mask and s.loss_mask[0] == 1 and s.loss_mask[-1] == 1
        assert s.reward is not None                           # the task scored the submitted answer


async def user_rollout(sample, turn, tokenizer):
    """A user's rollout function: two model turns with an environment message between them."""
    await turn(sample, 8, [tokenizer.eos_token_id])
    append_observation(sample, tokenizer.encode("\nagain:", add_special_tokens=False))
    await turn(sample, 8, [tokenizer.eos_token_id])
    sample.metadata["mine"] = True


def test_generate_fn_from_a_recipe_runs_the_users_function():
    recipe = load_recipe("recipes/tiny_agent_cpu.toml",
                         SMALL + ["rollout.agent=", "rollout.generate_fn=test_agent_recipe:user_rollout"],
                         check_files=False)
    agent, batch, metrics = asyncio.run(one_batch(recipe, lambda ids: TOK.encode("7", add_special_tokens=False)))
    assert isinstance(agent, FunctionAgent) and metrics["rollout/turns"] == 2.0
    for s in batch:
        s.check()
        assert s.metadata["mine"] and s.status == SampleStatus.COMPLETED and s.response_text == "77"
        assert s.loss_mask.count(0) == len(TOK.encode("\nagain:", add_special_tokens=False))


def test_single_turn_runs_log_one_turn():
    recipe = load_recipe("recipes/tiny_agent_cpu.toml", SMALL + ["rollout.agent="], check_files=False)
    agent, _, metrics = asyncio.run(one_batch(recipe, lambda ids: TOK.encode("7", add_special_tokens=False)))
    assert agent is None and metrics["rollout/turns"] == 1.0


def test_the_agent_recipe_trains_and_warm_starts_on_problems_its_eval_never_sees():
    recipe = load_recipe("recipes/tiny_agent_cpu.toml", SMALL, check_files=True)
    level = recipe.rollout.task.removesuffix(":train")
    assert recipe.rollout.task == f"{level}:train" and recipe.eval.datasets == [f"tool_task:{level}:eval"]
    assert recipe.eval.interval > 0 and recipe.eval.max_turns == recipe.rollout.max_turns
    rows = [json.loads(line) for line in open(recipe.sft.dataset)]
    assert len(rows) == 512 and {heldout_split(row["prompt"].rstrip("=")) for row in rows} == {"train"}


def test_every_agent_name_the_schema_accepts_is_built_here():
    assert set(AGENT_NAMES) - {""} == set(AGENTS)


@pytest.mark.parametrize("override,field", [
    ("rollout.agent=chatty", "rollout.agent"),
    ("rollout.generate_fn=not a path", "rollout.generate_fn"),
    ("rollout.generate_fn=pkg.mod:fn", "rollout.generate_fn"),            # together with rollout.agent
    ("rollout.max_episode_tokens=2", "rollout.max_episode_tokens"),
    ("rollout.max_turns=0", "rollout.max_turns"),
    ("rollout.agent=code_repair", "rollout.dataset"),                     # a task has no repositories
])
def test_bad_agent_values_are_one_line_errors_naming_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_recipe("recipes/tiny_agent_cpu.toml", SMALL + [override], check_files=False)
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_an_unimportable_generate_fn_is_refused_at_the_file_checks():
    with pytest.raises(ConfigError, match="^rollout.generate_fn"):
        load_recipe("recipes/tiny_agent_cpu.toml",
                    SMALL + ["rollout.agent=", "rollout.generate_fn=no_such_module_here:fn"], check_files=True)


FIXED = "def add(a, b):\n    return a + b\n"
REPAIR_ROW = {"id": "calc-add", "issue": "add(2, 3) returns -1", "files": {"calc.py": FIXED.replace("+", "-")},
              "tests": {"test_calc.py": "from calc import add\nassert add(2, 3) == 5\n"}}


@pytest.mark.parametrize("fix,reward", [(True, 1.0), (False, 0.0)])
def test_code_repair_agent_trains_on_rows_and_is_scored_by_the_hidden_tests(tmp_path, fix, reward):
    data = tmp_path / "repair.jsonl"
    data.write_text(json.dumps(REPAIR_ROW) + "\n")
    recipe = load_recipe("recipes/tiny_agent_cpu.toml", SMALL + [
        "rollout.agent=code_repair", f"rollout.dataset={data}", "rollout.prompt_key=issue", "rollout.task=",
        "rollout.max_new_tokens=128", "rollout.max_episode_tokens=400", "model.max_seq_len=512",
        "rollout.reward_timeout_s=60"], check_files=False)
    first = call("write_file", path="calc.py", content=FIXED) if fix else call("read_file", path="calc.py")
    _, batch, metrics = asyncio.run(one_batch(recipe, episode([first, call("submit", answer="")]), n=2))
    assert metrics["rollout/turns"] == 2.0
    for s in batch:
        s.check()
        context = TOK.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0])
        assert context.startswith("Files: calc.py")                # the episode opens with the file list
        assert s.reward == reward and s.metadata["files"]["calc.py"] != FIXED   # the row itself is untouched
