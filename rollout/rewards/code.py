"""Code-execution reward: run the response's program, then the label's tests, in the sandbox.

The program is the last ```python fenced block of the response (or the whole response when there is
none); the label holds test code: top-level asserts (``assert add(2, 3) == 5``) and the statements
they need. The tests are compared OUTSIDE the untrusted interpreter (code_checks.py): the sandbox
evaluates the asserted expressions after the program and sends their values back as plain data,
and this process compares them with the literal expected values, which never enter the sandbox.
Reward 1.0 only when every check holds: an exit before the tests end (``sys.exit(0)``,
``os._exit(0)``, killing the runner), an object whose ``__eq__`` always returns True, a printed
look-alike of the results line and frame or gc introspection all score 0. ``reward_info`` says
which sandbox limit was hit and why a check failed.

The sentinel harness below (a random line printed after the tests, in the same interpreter) is kept
for the code-repair eval's hidden tests (sao_megatron/evaluation/code_repair.py), whose tests are
whole files, not top-level asserts. Its residual risk: code written against it can read the sentinel
from the harness's frame (``sys._getframe(1).f_locals``), from ``gc`` or ``/proc/self/mem``, or
install a trace function that jumps over the remaining asserts; it stays inside the OS sandbox.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import replace
from typing import Optional

from rollout.rewards.sandbox import SandboxLimits, SandboxResult, run_python
from rollout.rewards.sandbox_bwrap import require_bwrap
from sao_megatron.core.records import Sample

from .code_checks import harness_script as checks_script, parse_tests, read_results, score

FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)
NONCE_FILE = ".sao_sentinel"
SENTINEL_PREFIX = "SAO-TESTS-RAN-TO-THE-END:"

# Runs in the sandbox. Everything it needs after the program runs is bound in _run's locals first.
HARNESS = '''import os as _os, sys as _sys


def _run(program, tests, exec=exec, compile=compile, write=_os.write, flush=_sys.stdout.flush,
         settrace=_sys.settrace, setprofile=_sys.setprofile, exit=_os._exit):
    with open({nonce_file!r}) as fh:
        nonce = fh.read()
    _os.remove({nonce_file!r})
    program_code = compile(program, "solution.py", "exec")
    tests_code = compile(tests, "tests.py", "exec")
    scope = {{"__name__": "__main__"}}
    exec(program_code, scope)
    settrace(None)
    setprofile(None)
    exec(tests_code, scope)
    flush()
    write(1, ("\\n" + nonce + "\\n").encode())
    exit(0)


_run({program!r}, {tests!r})
'''


def extract_program(response: str) -> str:
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else response


def harness_script(program: str, tests: str) -> str:
    """The sandbox script that runs `program` then `tests` and prints the sentinel after the tests."""
    return HARNESS.format(nonce_file=NONCE_FILE, program=program, tests=tests)


def new_sentinel() -> str:
    return SENTINEL_PREFIX + secrets.token_hex(16)


def tests_ran_to_the_end(result: SandboxResult, sentinel: str) -> bool:
    """The sentinel line is in the output's tail (the harness writes it last, then exits at once)."""
    return result.limit is None and sentinel in result.stdout_tail.splitlines()


class CodeReward:
    """The reward callable; ``from_config`` takes the isolation mode from ``rollout.sandbox`` and
    checks it before the run starts (bwrap missing is a one-line error naming that field)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits()):
        self.limits = limits

    @classmethod
    def from_config(cls, cfg) -> "CodeReward":
        limits = replace(SandboxLimits(), isolation=getattr(cfg, "sandbox", "bwrap"))
        if limits.isolation == "bwrap":
            require_bwrap()
        return cls(limits)

    async def __call__(self, sample: Sample, limits: Optional[SandboxLimits] = None) -> dict:
        if not isinstance(sample.label, str):
            raise ValueError(f"sample {sample.uid}: code rewards need test code (a string) as the label")
        try:
            plan = parse_tests(sample.label)
        except ValueError as err:
            raise ValueError(f"sample {sample.uid}: {err}") from None
        script = checks_script(extract_program(sample.response_text), plan)
        result = await run_python(script, limits or self.limits)
        results = read_results(result.stdout_tail) if result.limit is None else None
        passed, why = score(plan, results) if results is not None else (False, "the tests did not run to the end")
        last_err = (result.stderr.strip().splitlines()[-1:] or [""])[0]
        error = "" if passed else (why if results is not None or not last_err else last_err)
        return {"reward": 1.0 if passed else 0.0, "limit": result.limit or "", "error": error[:200],
                "network_isolated": result.network_isolated}


code_reward = CodeReward()
