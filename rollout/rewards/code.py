"""Code-execution reward: run the response's program, then the label's tests, in the sandbox.

The program is the last ```python fenced block of the response (or the whole response when there is
none); the label holds test code (e.g. asserts). Reward 1.0 only when the tests ran to their end: a
harness prints a random per-call sentinel after the last test statement, and the reward looks for
that exact line. The exit code is not trusted: ``sys.exit(0)``, ``os._exit(0)``, killing the
runner, an exception swallowed at exit or printing something that looks like a sentinel all score 0.
``reward_info`` says which sandbox limit was hit and the last stderr line.

How the sentinel stays out of the program's reach: it is made here (``secrets``), written to a file
in the run's working dir that the harness reads and deletes before the program runs (it is never in
argv, the environment or the source); the tests are compiled before the program runs and run in
their own ``exec`` with ``exec``/``compile``/``os.write`` bound before the program could replace
them, so a program that redefines builtins or ends in an unclosed string cannot skip them.

Residual risk (the program and the tests share one interpreter, so this is not a boundary): code
written to attack this harness can still read the sentinel from the harness's frame
(``sys._getframe(1).f_locals``), from ``gc`` or ``/proc/self/mem``, or install a trace function that
jumps over the remaining asserts. That takes deliberate introspection of this file's internals, shows
in the response text, and stays inside the OS sandbox; it is not stopped here.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import replace
from typing import Optional

from rollout.sandbox import SandboxLimits, SandboxResult, run_python
from rollout.sandbox_bwrap import require_bwrap
from sao_megatron.core.records import Sample

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
        sentinel = new_sentinel()
        script = harness_script(extract_program(sample.response_text), sample.label)
        result = await run_python(script, limits or self.limits, files={NONCE_FILE: sentinel})
        passed = tests_ran_to_the_end(result, sentinel)
        last_err = result.stderr.strip().splitlines()[-1:] or [""]
        error = last_err[0][:200] if last_err[0] or passed else "the tests did not run to the end"
        return {"reward": 1.0 if passed else 0.0, "limit": result.limit or "", "error": error,
                "network_isolated": result.network_isolated}


code_reward = CodeReward()
