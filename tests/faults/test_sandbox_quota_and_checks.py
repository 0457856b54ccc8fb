"""Issue 26.2: a sandbox run cannot fill the host disk, and the code reward's tests are compared
outside the untrusted interpreter.

Before: the working dir was a bind of a host directory, bounded only per file (RLIMIT_FSIZE), so
80 files of 7.5 MB (600 MB) or 40,000 empty files reached the host disk; the tests ran in the
program's interpreter, so an object whose ``__eq__`` always returns True passed them, and the random
sentinel could be read from the harness's frame. Every case switches the audit-hook guard off first
(tests/faults/test_sandbox_escapes.py), so only the OS isolation and the trusted side hold.
"""
from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from rollout.rewards.code import code_reward
from rollout.rewards.code_checks import harness_script as checks_script, parse_tests
from rollout.rewards.sandbox import SandboxLimits, run_python
from rollout.rewards.sandbox_bwrap import mib
from sao_megatron.core.records import Sample

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None and not os.environ.get("CI"),
                                reason="bubblewrap is not installed (apt-get install -y bubblewrap); CI has it")

LIMITS = SandboxLimits(wall_time_s=120, cpu_time_s=20, memory_mb=512, file_size_mb=8, max_processes=16,
                       write_mb=16, tmp_mb=16, max_files=500)
DISABLE_GUARD = "import sys\nsys.modules['__main__'].hook.__code__ = (lambda event, args: None).__code__\n"


def run(code: str):
    return asyncio.run(run_python(DISABLE_GUARD + code, LIMITS))


@pytest.mark.parametrize("where", ["", "/tmp/"])
def test_many_big_files_stop_at_the_write_quota(where):
    """80 files of 7.5 MB each (under the 8 MB per-file limit): the tmpfs fills at its size."""
    r = run(f"total = 0\ntry:\n    for i in range(80):\n        with open('{where}big%d' % i, 'wb') as fh:\n"
            "            fh.write(b'0' * (15 * 2**19))\n        total += 15 * 2**19\n"
            "finally:\n    print('written', total, flush=True)\n")
    written = int(r.stdout.split()[-1])
    assert r.limit == "write_quota", (r.limit, r.stderr[-300:])
    assert written <= mib(LIMITS.write_mb if not where else LIMITS.tmp_mb)


def test_many_empty_files_stop_at_the_file_count():
    """40,000 empty files, half in the working dir, half in /tmp: the run is stopped as 'files'
    long before (the count is read from outside every 20 ms, so it may pass max_files by that much)."""
    r = run("for i in range(40000):\n    open(('/tmp/' if i % 2 else '') + 'f%d' % i, 'w').close()\n"
            "    if i % 100 == 0:\n        print(i, flush=True)\nprint('all', flush=True)\n")
    assert r.limit == "files", (r.limit, r.stderr[-300:])
    assert "all" not in r.stdout_tail and int(r.stdout_tail.split()[-1]) < 40000


def test_a_run_still_reads_its_files_and_writes_within_the_quota():
    r = asyncio.run(run_python("import os\nopen('out', 'w').write(open('data.txt').read() * 2)\n"
                               "print(sorted(os.listdir('.')), open('out').read())\n", LIMITS,
                               files={"data.txt": "ab"}))
    assert r.ok and r.stdout == "['_guard.py', 'data.txt', 'main.py', 'out'] abab\n", r.stderr


def _score(program: str, tests: str = "assert add(2, 3) == 5\n") -> dict:
    sample = Sample(uid="p0", prompt_index=0, prompt_ids=[1], response_text=f"```python\n{program}```", label=tests)
    return asyncio.run(code_reward(sample, LIMITS))


ADD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
ALWAYS_EQUAL = ("class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
                "def add(a, b):\n    return Anything()\n")
FRAME_TRICK = ("import os, sys\nframe = sys._getframe(1)\n"
               "for value in list(frame.f_locals.values()):\n"
               "    if isinstance(value, str) and value.startswith('SAO-TESTS-RAN-TO-THE-END:'):\n"
               "        print(value, flush=True)\n        os._exit(0)\n")


@pytest.mark.parametrize("program", [ALWAYS_EQUAL, WRONG + FRAME_TRICK,
                                     "class Int(int):\n    def __eq__(self, other):\n        return True\n"
                                     "def add(a, b):\n    return Int(0)\n"],
                         ids=["always_equal", "frame_sentinel", "int_subclass"])
def test_always_equal_objects_and_frame_tricks_score_zero(program):
    out = _score(DISABLE_GUARD + program)
    assert out["reward"] == 0.0, out


def test_values_are_compared_outside_and_the_usual_tests_still_pass():
    tests = ("import math\nx = add(1, 1)\nassert x == 2\nassert add(0.5, 0.25) <= 0.75\n"
             "assert [add(1, 2)] == [3]\nassert add((1,), (2,)) == (1, 2)\nassert add('a', 'b') in {'ab', 'x'}\n"
             "assert add(1, 2) is not None\nassert math.isclose(add(0.1, 0.2), 0.3)\n")
    assert _score(ADD, tests)["reward"] == 1.0
    out = _score(ADD, tests + "assert add([1], [2]) == (1, 2)\n")   # a list is not a tuple
    assert out["reward"] == 0.0 and "tests line 10" in out["error"] and "got [1, 2]" in out["error"]


def test_the_expected_values_never_enter_the_sandbox():
    plan = parse_tests("assert add(2, 3) == 123456789\nassert 987654321 == add(4, 5)\n")
    assert [source for _, source in plan.steps] == ["add(2, 3)", "add(4, 5)"]
    script = checks_script(ADD, plan)   # all the sandbox gets: a program can read it, not the answers
    assert "123456789" not in script and "987654321" not in script


@pytest.mark.parametrize("label, needle", [
    ("for i in range(3):\n    assert add(i, i) == 2 * i\n", "line 2 is inside another statement"),
    ("x = add(1, 2)\n", "no top-level assert"),
    ("assert add(1, 2 ==\n", "do not parse"),
])
def test_a_label_the_trusted_side_cannot_check_is_refused_in_one_line(label, needle):
    with pytest.raises(ValueError, match=needle) as err:
        parse_tests(label)
    assert "\n" not in str(err.value)
