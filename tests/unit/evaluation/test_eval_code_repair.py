"""The code-repair benchmark: scripted policies through the real agent loop and sandbox, then the tiny model."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from checkpoints.init_model import build_tokenizer
from rollout.rewards.sandbox import SandboxLimits
from rollout.engines.scripted import ScriptedEngine as FakeEngine
from sao_megatron.core.config import ConfigError, EvalConfig, RolloutConfig
from sao_megatron.evaluation.code_repair import BadTask, CodeRepairEval, load_tasks, validate_task
from sao_megatron.evaluation.patches import PatchError, apply_submission
from sao_megatron.evaluation.runner import agentic_eval_for, evaluate_agentic, evaluate_all

TOK = build_tokenizer()
TINY_TASKS = Path(__file__).resolve().parents[3] / "data" / "eval" / "code_repair_tiny.jsonl"
CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TASK = {"id": "calc-add", "issue": "add(2, 3) returns -1", "files": {"calc.py": CALC},
        "tests": {"test_calc.py": "from calc import add, mul\nassert add(2, 3) == 5\nassert mul(2, 3) == 6\n"}}
FIX = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
WRONG = FIX.replace("a + b", "a * b")
LIMITS = SandboxLimits(wall_time_s=120, cpu_time_s=1, memory_mb=512, file_size_mb=1)   # wall: loaded CI machines


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def scripted_policy(turns, seen=None):
    """A fake engine whose n-th turn (n = tool responses so far) writes turns[n]; `seen` gets each input."""
    def script(input_ids):
        text = TOK.decode(input_ids, skip_special_tokens=False)
        if seen is not None:
            seen.append(text)
        return TOK.encode(turns[min(text.count("<tool_response>"), len(turns) - 1)], add_special_tokens=False)
    return FakeEngine("policy", script=script)


def make_env(tmp_path, rows=(TASK,), limits=LIMITS) -> CodeRepairEval:
    path = tmp_path / "repair.jsonl"
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return CodeRepairEval(str(path), max_turns=4, max_turn_tokens=1024, max_episode_tokens=8192,
                          sandbox_limits=limits)


def episode(env, turns, seen=None):
    return asyncio.run(env.run_episode(scripted_policy(turns, seen), TOK, env.problems()[0], seed=0))


def test_a_correct_diff_after_reading_the_file_scores_one(tmp_path):
    seen = []
    result = episode(make_env(tmp_path), [call("read_file", path="calc.py"), call("submit", answer=FIX)], seen)
    assert result.score == 1.0 and result.error == ""
    assert result.info["submitted"] and result.info["turns"] == 2 and result.info["task"] == "calc-add"
    assert "Issue: add(2, 3) returns -1" in seen[0] and "test_calc" not in seen[0]     # hidden tests stay hidden
    assert "<tool_response>def add(a, b):\n    return a - b" in seen[1]


def test_edits_by_write_file_are_what_python_runs_and_what_is_scored(tmp_path):
    seen = []
    turns = [call("read_file", path="../../etc/passwd"),
             call("write_file", path="calc.py", content=CALC.replace("a - b", "a + b")),
             call("python", code="from calc import add\nprint(add(2, 3))"),
             call("submit", answer="")]
    result = episode(make_env(tmp_path), turns, seen)
    assert "error: path '../../etc/passwd' is outside the repository" in seen[1]
    assert seen[3].endswith("<tool_response>5\n</tool_response>\n")
    assert result.score == 1.0 and result.error == ""


def test_a_wrong_fix_is_a_verdict_not_an_error(tmp_path):
    result = episode(make_env(tmp_path), [call("submit", answer=WRONG)])
    assert result.score == 0.0 and result.error == "" and "AssertionError" in result.info["test_error"]


@pytest.mark.parametrize("exit_call", ["import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n",
                                       "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"])
def test_a_fix_that_exits_cleanly_before_the_tests_finish_scores_zero(tmp_path, exit_call):
    """Exit code 0 is not a pass: the tests must run to their end (the harness's sentinel)."""
    fix = {"calc.py": exit_call + CALC}
    result = episode(make_env(tmp_path), [call("submit", answer=json.dumps(fix))])
    assert result.score == 0.0 and result.error == "", result


def test_an_unsubmitted_episode_is_scored_on_the_files_as_written(tmp_path):
    result = episode(make_env(tmp_path), ["I give up<|im_end|>"])
    assert result.score == 0.0 and not result.info["submitted"] and result.info["status"] == "completed"


@pytest.mark.parametrize("body,limits,limit", [
    ("    import time\n    time.sleep(60)\n", SandboxLimits(wall_time_s=2), "wall_time"),
    ("    while True:\n        pass\n", LIMITS, "cpu_time"),
    ("    open('big.bin', 'wb').write(b'0' * 4 * 1024 * 1024)\n    return a + b\n", LIMITS, "file_size"),
])
def test_a_fix_that_hits_a_sandbox_limit_scores_zero_with_the_limit_named(tmp_path, body, limits, limit):
    fix = {"calc.py": CALC.replace("    return a - b\n", body)}
    result = episode(make_env(tmp_path, limits=limits), [call("submit", answer=json.dumps(fix))])
    assert result.score == 0.0 and result.error == f"hidden tests hit the sandbox {limit} limit"


@pytest.mark.parametrize("answer,needle", [
    ("replace the minus with a plus", "no '--- a/PATH' + '+++ b/PATH' header"),
    (FIX.replace("-    return a - b", "-    return b - a"), "calc.py: hunk at line 1 does not match"),
    ("--- a/calc.py\n+++ b/calc.py\n@@ -1,3 +1,3 @@\n def add(a, b):\n", "hunk ends early"),
    ('{"../outside.py": "x"}', "is outside the repository"),
    ('{"runpy.py": "def run_path(*a, **k): pass"}', "adds runpy.py, which shadows the standard library"),
])
def test_a_malformed_or_test_rigging_submission_scores_zero_with_the_reason(tmp_path, answer, needle):
    result = episode(make_env(tmp_path), [call("submit", answer=answer)])
    assert result.score == 0.0 and needle in result.error
    assert result.error.startswith("malformed patch: ") or "shadows" in result.error


def test_bad_rows_score_zero_with_their_line_and_the_set_reports_pass_and_avg_at_k(tmp_path):
    env = make_env(tmp_path, rows=[TASK, "{not json", {"id": "x", "files": {}, "tests": {}}])
    assert [type(p).__name__ for p in env.problems()] == ["RepairTask", "BadTask", "BadTask"]
    episodes = []
    out = asyncio.run(evaluate_agentic([scripted_policy([call("submit", answer=FIX)])], TOK, env, k=2,
                                       episodes=episodes))
    assert out == {"avg@2": pytest.approx(1 / 3), "pass@1": pytest.approx(1 / 3), "pass@2": pytest.approx(1 / 3),
                   "problems": 3.0, "errors": 4.0}
    errors = [e["error"] for e in episodes if e["error"]]
    assert errors[0].startswith("bad task at line 2: not valid JSON")
    assert errors[2] == "bad task at line 3: missing or empty 'issue' (a string)"


def test_an_episode_that_raises_scores_zero_and_the_eval_goes_on(tmp_path):
    dead = FakeEngine("dead")
    dead.kill()
    episodes = []
    out = asyncio.run(evaluate_agentic([dead], TOK, make_env(tmp_path), k=1, episodes=episodes))
    assert out["pass@1"] == 0.0 and out["errors"] == 1.0 and "EngineError" in episodes[0]["error"]


def test_recipe_sources_reach_the_environment_through_evaluate_all(tmp_path):
    env = make_env(tmp_path)
    cfg = EvalConfig(datasets=[f"code_repair:{env.path}"], k=2, max_turns=3, max_episode_tokens=4096)
    built = agentic_eval_for(cfg.datasets[0], cfg, RolloutConfig(max_new_tokens=512, temperature=0.7))
    assert (built.name, built.max_turns, built.max_turn_tokens, built.max_episode_tokens, built.temperature) == \
        ("repair", 3, 512, 4096, 0.7)
    out = asyncio.run(evaluate_all([scripted_policy([call("submit", answer=FIX)])], TOK, cfg,
                                   RolloutConfig(max_new_tokens=512)))
    assert out["eval/repair/pass@2"] == 1.0 and out["eval/repair/avg@2"] == 1.0 and out["eval/repair/errors"] == 0


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="eval.max_turns"):
        EvalConfig(max_turns=0).check("eval")
    with pytest.raises(ConfigError, match="eval.max_episode_tokens"):
        EvalConfig(max_turns=8, max_episode_tokens=4).check("eval")
    with pytest.raises(ConfigError, match="unknown source scheme 'swe'"):
        agentic_eval_for("swe:tasks.jsonl", EvalConfig(), RolloutConfig())
    with pytest.raises(ConfigError, match="does not exist"):
        agentic_eval_for("code_repair:no/such/file.jsonl", EvalConfig(), RolloutConfig())
    assert agentic_eval_for("task:arithmetic", EvalConfig(), RolloutConfig()) is None


def test_every_shipped_task_fails_before_and_passes_with_its_gold_patch():
    tasks = load_tasks(str(TINY_TASKS))
    assert 3 <= len(tasks) <= 5 and not any(isinstance(t, BadTask) for t in tasks)
    assert [asyncio.run(validate_task(t, LIMITS)) for t in tasks] == [None] * len(tasks)


def test_unified_diffs_apply_with_offsets_new_and_deleted_files():
    files = {"a.py": "1\n2\n3\n4\n5\n", "old.py": "x\n"}
    diff = ("```diff\n--- a/a.py\n+++ b/a.py\n@@ -1,2 +1,2 @@\n-1\n+one\n 2\n"
            "@@ -9,1 +9,2 @@\n 4\n+4.5\n"            # stated line 9 is wrong: placed at the match (line 4)
            "--- /dev/null\n+++ b/pkg/new.py\n@@ -0,0 +1 @@\n+new\n"
            "--- a/old.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n```")
    assert apply_submission(files, diff) == {"a.py": "one\n2\n3\n4\n4.5\n5\n", "pkg/new.py": "new\n"}
    assert files["a.py"] == "1\n2\n3\n4\n5\n"                              # the input is not modified
    with pytest.raises(PatchError, match="no such file"):
        apply_submission(files, "--- a/b.py\n+++ b/b.py\n@@ -1 +1 @@\n-1\n+2\n")
    assert apply_submission(files, '{"a.py": "z\\n"}')["a.py"] == "z\n" and apply_submission(files, " ") == files


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from rollout.engines.reference_server import launch_local

    handle = launch_local(tiny_model_dir, api_key="k", seed=0)
    yield handle
    handle.stop()


def test_the_tiny_model_runs_the_shipped_tasks_end_to_end(server, tiny_model_dir):
    from transformers import AutoTokenizer

    from rollout.engines.sglang_client import SGLangEngine

    cfg = EvalConfig(datasets=[f"code_repair:{TINY_TASKS}"], k=2, max_problems=2, max_turns=2, max_episode_tokens=64)

    async def go(episodes):
        client = SGLangEngine(server.url, api_key="k", name="eval")
        try:
            return await evaluate_all([client], AutoTokenizer.from_pretrained(tiny_model_dir), cfg,
                                      RolloutConfig(max_new_tokens=8), seed=5, episodes=episodes)
        finally:
            await client.close()

    episodes = []
    first = asyncio.run(go(episodes))
    assert first["eval/code_repair_tiny/problems"] == 2 and first["eval/code_repair_tiny/errors"] == 0
    assert 0.0 <= first["eval/code_repair_tiny/avg@2"] <= 1.0
    assert first["eval/code_repair_tiny/pass@1"] <= first["eval/code_repair_tiny/pass@2"] <= 1.0
    assert len(episodes) == 4 and all(e["turns"] >= 1 for e in episodes)
    assert asyncio.run(go([])) == first                  # seeded sampling: the same seed, the same numbers


def test_sao_eval_names_a_missing_task_file_before_starting_engines(tiny_model_dir, tmp_path, capsys):
    from sao_megatron.cli.main import main

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe_cpu.toml"
    code = main(["eval", str(recipe), f"run.output_dir='{tmp_path}'", "eval.datasets=['code_repair:nope.jsonl']",
                 "--checkpoint", str(tiny_model_dir)])
    assert code == 2 and "code_repair task file nope.jsonl does not exist" in capsys.readouterr().err


def test_episodes_are_capped_to_the_context_and_a_prompt_that_does_not_fit_scores_zero_naming_it(tmp_path):
    """Each turn asks for 1024 tokens; an engine refusing prompt + max_new_tokens past 600 (as SGLang
    does) is never sent such a request, and the fix still scores 1. A context the prompt alone fills
    scores 0 with a one-line reason and sends nothing."""
    from context_engine import ContextEngine

    cfg = EvalConfig(datasets=[f"code_repair:{tmp_path / 'repair.jsonl'}"], k=1)
    make_env(tmp_path)
    built = agentic_eval_for(cfg.datasets[0], cfg, RolloutConfig(max_new_tokens=1024), context_length=600)
    assert built.context_length == 600 and built.max_turn_tokens == 1024
    policy = scripted_policy([call("submit", answer=FIX)])
    engine = ContextEngine("policy", context=600, script=policy.script)
    episodes = []
    out = asyncio.run(evaluate_agentic([engine], TOK, built, k=1, episodes=episodes))
    assert out["pass@1"] == 1.0 and out["errors"] == 0, episodes
    assert engine.requests and all(n + m == 600 for n, m in engine.requests)
    tight = agentic_eval_for(cfg.datasets[0], cfg, RolloutConfig(max_new_tokens=1024), context_length=10)
    engine = ContextEngine("policy", context=10, script=policy.script)
    episodes = []
    out = asyncio.run(evaluate_agentic([engine], TOK, tight, k=1, episodes=episodes))
    assert out["pass@1"] == 0.0 and out["errors"] == 1.0 and engine.requests == []
    assert episodes[0]["error"].startswith("PromptTooLong: prompt of ") and \
        episodes[0]["error"].endswith("does not fit the context of 10 tokens (model.max_seq_len); "
                                      "shorten the prompt or raise model.max_seq_len")
