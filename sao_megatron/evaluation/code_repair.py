"""A SWE-bench-style code-repair benchmark: fix a small repository so that its hidden tests pass.

Task file (jsonl, one task per line; `eval.datasets = ["code_repair:PATH"]`):
    {"id": "calc-add",                       # unique name, used in per-episode reports
     "issue": "add(2, 3) returns -1",        # what the model is told
     "files": {"calc.py": "..."},            # the repository, path -> content
     "tests": {"test_calc.py": "..."},       # hidden tests: added at scoring time, never shown
     "test_command": "",                     # optional Python run in the repository root instead of
                                             #   the default (each hidden test file run as __main__)
     "gold_patch": "..."}                    # optional reference fix, used only by `validate_task`

Episode: the model sees the issue and the file list and acts through the agent's tool protocol
(rollout/agents/tool_loop.py) with four tools: ``read_file {path}``, ``write_file {path, content}`` (edit the
in-memory repository), ``python {code}`` (run code in the sandbox with the repository as its
working directory; each call starts from the current files, so edits persist only through
write_file) and ``submit {answer}`` where the answer is a unified diff, a JSON object
``{path: content}``, or "" for the repository as written (patches.py). An episode that ends without
submit is scored on the repository as written.

Score: the final repository plus the hidden tests run in the sandbox (rollout/rewards/sandbox.py); 1.0 only
when the tests ran to their end (the random sentinel of rollout/rewards/code.py is printed after
them; the exit code is not trusted, a fix that calls os._exit(0) on import scores 0), else 0.0. Environment failures also score 0.0, with `EpisodeResult.error` saying why:
a bad task row (with its line), a malformed patch, a new top-level file that shadows a standard
library module (the test runner imports from the repository root), a sandbox limit during the tests.
A wrong fix (the tests fail) is a verdict, not an error: its last stderr line is in `info`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rollout.agents.tool_loop import ToolAgent, ToolCall, observation_budget
from rollout.engines.engine import Generator
from rollout.rewards.code import NONCE_FILE, harness_script, new_sentinel, tests_ran_to_the_end
from rollout.rewards.sandbox import SandboxLimits, SandboxResult, run_python
from sao_megatron.core.config.errors import ConfigError
from sao_megatron.core.records import Sample

from .patches import PatchError, apply_submission, safe_path
from .runner import AgenticEval, EpisodeResult, encode_prompt, engine_turn

log = logging.getLogger(__name__)

TOOLS = ("read_file", "write_file", "python", "submit")
INSTRUCTIONS = (
    "Fix the repository so that its hidden tests pass. Call one tool per turn as "
    '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>. Tools: read_file {"path"}; '
    'write_file {"path", "content"}; python {"code"} (runs in the repository root); '
    'submit {"answer"}: a unified diff, a JSON object {path: content}, or "" for the files as written.'
)

# Runs inside the sandbox: writes the repository into the scratch dir, then the payload in it.
WORKSPACE_SCRIPT = '''import json, os, sys
sys.dont_write_bytecode = True               # no __pycache__ in the repository
os.mkdir("repo")
for path, text in json.loads({files}).items():
    full = os.path.join("repo", path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as fh:
        fh.write(text)
os.chdir("repo")
sys.path.insert(0, os.getcwd())              # python -I leaves the working directory off sys.path
exec(compile({code}, "main.py", "exec"), {{"__name__": "__main__"}})
'''


def workspace_script(files: dict[str, str], code: str) -> str:
    """A sandbox script that materialises `files` and runs `code` in the repository root."""
    return WORKSPACE_SCRIPT.format(files=repr(json.dumps(files)), code=repr(code))


@dataclass(frozen=True)
class RepairTask:
    task_id: str
    line: int
    issue: str
    files: dict
    tests: dict
    test_command: str = ""
    gold_patch: str = ""

    def test_code(self) -> str:
        if self.test_command:
            return self.test_command
        paths = sorted(self.tests)
        return f"import runpy\nfor path in {paths!r}:\n    runpy.run_path(path, run_name='__main__')\n"


@dataclass(frozen=True)
class BadTask:
    """A task row that cannot be used: scored 0 with `reason`, so the denominator stays honest."""

    line: int
    reason: str


def load_tasks(path: str) -> list:
    """RepairTask per good row, BadTask (with its line) per bad one. A missing file is a ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("eval.datasets", f"code_repair task file {path} does not exist",
                          "give the jsonl path relative to the working directory")
    tasks = []
    with p.open() as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                tasks.append(_task_from_record(json.loads(line), line_no))
            except (json.JSONDecodeError, ValueError, TypeError) as exc:
                reason = f"not valid JSON ({exc.msg})" if isinstance(exc, json.JSONDecodeError) else str(exc)
                log.warning("%s: bad task at line %d: %s; it scores 0", path, line_no, reason)
                tasks.append(BadTask(line_no, reason))
    return tasks


def _task_from_record(record, line: int) -> RepairTask:
    if not isinstance(record, dict):
        raise ValueError(f"row is {type(record).__name__}, expected an object")
    for name in ("id", "issue"):
        if not isinstance(record.get(name), str) or not record[name]:
            raise ValueError(f"missing or empty {name!r} (a string)")
    for name in ("files", "tests"):
        value = record.get(name)
        if not isinstance(value, dict) or not value or not all(isinstance(v, str) for v in value.values()):
            raise ValueError(f"{name!r} must be a non-empty object {{path: content}}")
    for name in ("test_command", "gold_patch"):
        if not isinstance(record.get(name, ""), str):
            raise ValueError(f"{name!r} must be a string")
    files = {safe_path(k): v for k, v in record["files"].items()}
    tests = {safe_path(k): v for k, v in record["tests"].items()}
    return RepairTask(record["id"], line, record["issue"], files, tests,
                      record.get("test_command", ""), record.get("gold_patch", ""))


class RepoAgent(ToolAgent):
    """The tool loop of rollout/agents/tool_loop.py with tools that act on one task's repository."""

    def __init__(self, tokenizer, workspace: dict[str, str], **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.workspace = workspace          # edited in place by write_file

    async def _run_tool(self, call) -> str:
        if isinstance(call, str):           # a malformed call: its error message is the observation
            return call
        if call.name == "python":
            code = call.arguments.get("code")
            if not isinstance(code, str):
                return 'error: python needs {"code": str}'
            return await super()._run_tool(ToolCall("python", {"code": workspace_script(self.workspace, code)}, True))
        if call.name in ("read_file", "write_file"):
            try:
                path = safe_path(call.arguments.get("path"))
            except PatchError as exc:
                return f"error: {exc}"
            return self._read(path) if call.name == "read_file" else self._write(path, call.arguments.get("content"))
        return f"error: unknown tool {call.name!r}; tools are {', '.join(TOOLS)}"

    def _read(self, path: str) -> str:
        if path not in self.workspace:
            return f"error: no file {path}; files: {', '.join(sorted(self.workspace))}"
        return self.workspace[path]

    def _write(self, path: str, content) -> str:
        if not isinstance(content, str):
            return 'error: write_file needs {"path": str, "content": str}'
        self.workspace[path] = content
        return f"wrote {len(content)} characters to {path}"


@dataclass
class CodeRepairEval(AgenticEval):
    """eval/<file stem>/pass@k and avg@k over a code-repair task file (module docstring)."""

    path: str
    max_turns: int = 8
    max_turn_tokens: int = 256
    max_episode_tokens: int = 2048
    temperature: float = 1.0
    sandbox_limits: SandboxLimits = SandboxLimits(wall_time_s=10, cpu_time_s=5, memory_mb=512, file_size_mb=8)
    context_length: Optional[int] = None     # model.max_seq_len: prompt + episode never passes it
    tasks: list = field(init=False)

    def __post_init__(self):
        self.name = Path(self.path).stem
        self.tasks = load_tasks(self.path)

    @classmethod
    def from_source(cls, arg: str, eval_cfg, rollout_cfg, context_length: Optional[int] = None) -> "CodeRepairEval":
        from .runner import eval_sampling

        limits = dataclasses.replace(cls.sandbox_limits, isolation=getattr(rollout_cfg, "sandbox", "bwrap"))
        temperature, _, max_new_tokens = eval_sampling(eval_cfg, rollout_cfg)
        return cls(arg, max_turns=eval_cfg.max_turns, max_turn_tokens=max_new_tokens,
                   max_episode_tokens=eval_cfg.max_episode_tokens, temperature=temperature,
                   sandbox_limits=limits, context_length=context_length)

    def problems(self) -> list:
        return list(self.tasks)

    async def run_episode(self, engine: Generator, tokenizer, problem, seed: int) -> EpisodeResult:
        if isinstance(problem, BadTask):
            return EpisodeResult(0.0, error=f"bad task at line {problem.line}: {problem.reason}")
        workspace = dict(problem.files)
        sample = Sample(uid=f"{self.name}-{problem.task_id}-{seed}", prompt_index=problem.line,
                        prompt_ids=encode_prompt(tokenizer, self.messages(problem)))
        turn = engine_turn(engine, seed, self.temperature, self.context_length)
        await self.agent(tokenizer, workspace).rollout(sample, turn)
        info = {"task": problem.task_id, "turns": sample.metadata.get("turns", 0),
                "submitted": "submitted" in sample.metadata, "status": sample.status.value}
        try:
            final = apply_submission(workspace, sample.metadata.get("submitted", ""))
        except PatchError as exc:
            return EpisodeResult(0.0, error=f"malformed patch: {exc}", info=info)
        shadowing = sorted(p for p in final if p not in problem.files and _top_module(p) in sys.stdlib_module_names)
        if shadowing:      # e.g. a runpy.py or unittest/ of its own would let a fix rewrite the test runner
            return EpisodeResult(0.0, error=f"the fix adds {shadowing[0]}, which shadows the standard library",
                                 info=info)
        result = await self.score(problem, final)
        result.info = {**info, **result.info}
        return result

    def messages(self, task: RepairTask) -> list[dict]:
        listing = ", ".join(sorted(task.files))
        return [{"role": "system", "content": INSTRUCTIONS},
                {"role": "user", "content": f"Issue: {task.issue}\nFiles: {listing}"}]

    def agent(self, tokenizer, workspace: dict[str, str]) -> RepoAgent:
        return RepoAgent(tokenizer, workspace, max_turns=self.max_turns, max_turn_tokens=self.max_turn_tokens,
                         max_total_tokens=self.max_episode_tokens,
                         max_observation_tokens=observation_budget(self.max_episode_tokens, self.max_turns),
                         sandbox_limits=self.sandbox_limits, context_length=self.context_length)

    async def score(self, task: RepairTask, files: dict[str, str]) -> EpisodeResult:
        """Run the hidden tests against `files` (hidden test files win over same-named ones)."""
        passed, result = await run_hidden_tests(task, files, self.sandbox_limits)
        if result.limit:
            return EpisodeResult(0.0, error=f"hidden tests hit the sandbox {result.limit} limit")
        if not passed:   # exit 0 alone is not trusted: a fix can os._exit(0)
            last = (result.stderr.strip().splitlines() or [f"the tests did not run to the end "
                                                            f"(exit code {result.returncode})"])[-1]
            return EpisodeResult(0.0, info={"test_error": last[:200]})
        return EpisodeResult(1.0)


def _top_module(path: str) -> str:
    top = path.split("/")[0]
    return top[:-3] if top.endswith(".py") else top


async def run_hidden_tests(task: RepairTask, files: dict[str, str],
                           limits: SandboxLimits) -> tuple[bool, SandboxResult]:
    """(passed, result). The repository is written by the harness's trusted first part; the hidden
    tests (which import the fix) run second, and pass only if they ran to their end: a fresh random
    sentinel printed after them (rollout/rewards/code.py)."""
    sentinel = new_sentinel()
    setup = workspace_script({**files, **task.tests}, "")
    result = await run_python(harness_script(setup, task.test_code()), limits, files={NONCE_FILE: sentinel})
    return tests_ran_to_the_end(result, sentinel), result


async def validate_task(task, limits: SandboxLimits = SandboxLimits()) -> Optional[str]:
    """None if the hidden tests fail on the given files and pass with the gold patch; else the problem."""
    if isinstance(task, BadTask):
        return f"line {task.line}: {task.reason}"
    if (await run_hidden_tests(task, task.files, limits))[0]:
        return f"{task.task_id}: the hidden tests already pass before any fix"
    if not task.gold_patch:
        return f"{task.task_id}: no gold_patch to check the tests against"
    try:
        fixed = apply_submission(task.files, task.gold_patch)
    except PatchError as exc:
        return f"{task.task_id}: gold_patch does not apply: {exc}"
    passed, result = await run_hidden_tests(task, fixed, limits)
    if not passed:
        why = result.limit or result.stderr.strip()[-200:]
        return f"{task.task_id}: the hidden tests fail with the gold patch: {why}"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m sao_megatron.evaluation.code_repair FILE`: check every task of a task file."""
    import asyncio

    path = (argv if argv is not None else sys.argv[1:])[0]
    problems = []
    for task in load_tasks(path):
        problem = asyncio.run(validate_task(task))
        print(problem or f"{task.task_id}: ok")
        problems.append(problem)
    return 1 if any(problems) else 0


if __name__ == "__main__":
    sys.exit(main())
