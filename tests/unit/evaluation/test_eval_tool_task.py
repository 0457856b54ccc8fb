"""`tool_task:TASK`: the python-tool agent's held-out eval, through the real agent loop and sandbox with
scripted policies (sao_megatron/evaluation/tool_task.py)."""
from __future__ import annotations

import asyncio
import json
import random
import re

import pytest

from checkpoints.init_model import build_tokenizer
from rollout.engines.scripted import ScriptedEngine
from rollout.rewards.sandbox import SandboxLimits
from rollout.rewards.tasks import get_task
from sao_megatron.core.config import ConfigError, EvalConfig, RolloutConfig
from sao_megatron.core.config.installed import check_eval_source
from sao_megatron.evaluation.runner import evaluate_agentic, evaluate_all
from sao_megatron.evaluation.tool_task import ToolTaskEval

TOK = build_tokenizer()
LIMITS = SandboxLimits(wall_time_s=120, cpu_time_s=1, memory_mb=512, file_size_mb=1)   # wall: loaded CI machines


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def policy(first_turn, second_turn=None, seen=None):
    """A scripted engine: first_turn(problem expression) before any tool output, then
    second_turn(last tool output)."""
    def script(input_ids):
        text = TOK.decode(input_ids, skip_special_tokens=False)
        if seen is not None:
            seen.append(text)
        outputs = re.findall(r"<tool_response>(.*?)</tool_response>", text, re.DOTALL)
        if not outputs:
            expression = re.search(r"(\d+(?:[+-]\d+)+)=", text).group(1)
            return TOK.encode(first_turn(expression), add_special_tokens=False)
        return TOK.encode(second_turn(outputs[-1].strip()), add_special_tokens=False)
    return ScriptedEngine("policy", script=script)


def env(task="chain:1:1:eval", **kwargs) -> ToolTaskEval:
    return ToolTaskEval(task, **{"max_turns": 3, "max_turn_tokens": 64, "max_episode_tokens": 256,
                                 "sandbox_limits": LIMITS, **kwargs})


def solve(expression):
    return call("python", code=f"print({expression})")


def test_an_agent_that_computes_with_python_and_submits_the_output_solves_every_problem():
    seen = []
    result = asyncio.run(evaluate_agentic([policy(solve, lambda out: call("submit", answer=out), seen)], TOK,
                                          env(max_problems=8), k=2))
    assert result["avg@2"] == 1.0 and result["pass@2"] == 1.0 and result["errors"] == 0.0
    assert result["problems"] == 8.0
    assert any("<tool_response>" in text for text in seen)      # the answer came from the sandbox's output


def test_the_score_is_the_tasks_own_checker_on_the_submitted_answer():
    wrong = asyncio.run(evaluate_agentic([policy(solve, lambda out: call("submit", answer=str(int(out) + 100)))],
                                         TOK, env(max_problems=4), k=1))
    assert wrong["avg@1"] < 0.5 and wrong["pass@1"] == 0.0       # chain gives partial credit, never a pass
    problem = env(max_problems=1).problems()[0]
    plain = asyncio.run(env(max_problems=1).run_episode(policy(lambda e: str(eval(e))), TOK, problem, seed=0))
    assert plain.score == 1.0 and not plain.info["submitted"] and plain.info["turns"] == 1   # text, no call


def test_the_held_out_problems_are_distinct_and_never_a_training_prompt():
    problems = env(max_problems=0).problems()
    texts = [p.prompt for p in problems]
    assert len(texts) == len(set(texts)) and 20 <= len(texts) < 64    # chain:1:1 holds out about 30 of 155
    rng = random.Random(0)
    train = {get_task("chain:1:1:train").make(rng).text for _ in range(3000)}
    assert not train & set(texts)


def test_hostile_code_ends_in_the_sandboxs_verdict_not_a_hang_or_an_escape():
    seen = []
    loop = lambda e: call("python", code="while 1: pass")   # noqa: E731
    result = asyncio.run(evaluate_agentic([policy(loop, lambda out: call("submit", answer=out), seen)], TOK,
                                          env(max_problems=1, max_turn_tokens=128), k=1))
    assert result["avg@1"] == 0.0 and result["errors"] == 0.0          # a verdict on the episode ...
    assert re.search(r"<tool_response>error: (cpu_time|wall_time) limit exceeded", seen[-1])   # ... from the sandbox


def test_a_recipe_names_it_and_a_bad_task_is_one_line_naming_the_field():
    check_eval_source("tool_task:chain:1:1:eval")                       # a task name, not a file
    with pytest.raises(ConfigError, match="eval.datasets") as err:
        check_eval_source("tool_task:chain:1:1:test")
    assert "chain:K:D[:train|:eval]" in str(err.value)
    eval_cfg = EvalConfig(datasets=["tool_task:chain:1:1:eval"], k=2, max_problems=3, max_turns=3,
                          max_episode_tokens=256)
    rollout_cfg = RolloutConfig(sandbox="unsafe-no-isolation", max_new_tokens=64)
    out = asyncio.run(evaluate_all([policy(solve, lambda out: call("submit", answer=out))], TOK, eval_cfg,
                                   rollout_cfg))
    assert out["eval/tool_task-chain-1-1-eval/avg@2"] == 1.0 and out["eval/tool_task-chain-1-1-eval/problems"] == 3.0


def test_sao_eval_of_the_agent_recipe_from_another_directory_checks_only_what_eval_uses(tiny_model_dir, tmp_path,
                                                                                      monkeypatch, capsys):
    """The recipe's sft.dataset is relative to the repository; eval runs no SFT, so it is not checked."""
    from pathlib import Path

    from sao_megatron.cli.main import main

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "tiny_agent_cpu.toml"
    monkeypatch.chdir(tmp_path)
    code = main(["eval", str(recipe), f"run.output_dir='{tmp_path}'", "eval.datasets=['code_repair:nope.jsonl']",
                 "--checkpoint", str(tiny_model_dir)])
    err = capsys.readouterr().err
    assert code == 2 and "code_repair task file nope.jsonl does not exist" in err and "sft.dataset" not in err
