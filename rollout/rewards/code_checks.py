"""The code reward's tests, compared outside the untrusted interpreter.

The label's test code is parsed here, in the trusted process. Each top-level ``assert`` becomes a
check: the expressions it compares are evaluated in the sandbox, after the program, and their values
come back serialised as plain data (exact built-in types only: None, bool, int, float, str, bytes,
list, tuple, dict, set, frozenset); the comparison itself runs here. A literal side of a comparison
(``assert add(2, 3) == 5``: the ``5``) never enters the sandbox. So:
- an object whose ``__eq__`` always returns True cannot be serialised: the check fails;
- the program can read everything the sandbox holds (frames, gc, the harness's source), but the
  expected values of literal comparisons are not there, and no sentinel is either: the only way to
  make those checks pass is to produce the right values.
Every other top-level statement (imports, helper definitions, assignments) runs in the sandbox in its
place between the checks. Asserts nested inside other statements are refused: they would run inside
the untrusted interpreter, so the label is an error (one line, naming the line), not a silent pass.

Residual (docs/reliability.md): a check whose expected value is not a literal (``assert f(1) == g(2)``,
``assert ok(x)``) is computed in the sandbox, so a program that takes over the harness can forge it
(it knows the expected answer: it computed it, or it is True); the results line can be forged too,
but only with values the program computes itself.
"""
from __future__ import annotations

import ast
import json
import operator
from dataclasses import dataclass
from typing import Any, Optional

RESULTS_PREFIX = "SAO-TEST-RESULTS:"
MAX_DEPTH = 50
OPERATORS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
             ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
             ast.NotIn: lambda a, b: a not in b, ast.Is: lambda a, b: type(a) is type(b) and a == b,
             ast.IsNot: lambda a, b: not (type(a) is type(b) and a == b)}
_MISSING = object()


@dataclass
class Check:
    """One top-level assert: `left op right`, or the truth of `left` when op is None. A side that is
    a literal holds its value here (and is never sent); the other is an expression evaluated in the
    sandbox, whose result arrives at `left_step` / `right_step` of the results."""
    line: int
    text: str
    op: Optional[type] = None
    left_value: Any = _MISSING
    right_value: Any = _MISSING
    left_step: int = -1
    right_step: int = -1


@dataclass
class TestPlan:
    steps: list[tuple[str, str]]   # ("exec" | "eval", source) in order, sent to the sandbox
    checks: list[Check]


def parse_tests(source: str) -> TestPlan:
    """The label's test code as steps for the sandbox and checks kept here; ValueError (one line)
    for code that does not parse, has no top-level assert, or nests one."""
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise ValueError(f"the label's tests do not parse (line {err.lineno}: {err.msg})") from None
    steps: list[tuple[str, str]] = []
    checks: list[Check] = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Assert):
            nested = next((n for n in ast.walk(stmt) if isinstance(n, ast.Assert)), None)
            if nested is not None:
                raise ValueError(f"the label's tests: the assert on line {nested.lineno} is inside another statement; "
                                 "code rewards compare top-level asserts outside the sandbox, so write each as "
                                 "its own top-level `assert EXPR == VALUE`")
            steps.append(("exec", ast.unparse(stmt)))
            continue
        checks.append(_check(stmt, steps))
    if not checks:
        raise ValueError("the label's tests hold no top-level assert; write them as `assert EXPR == VALUE`")
    return TestPlan(steps, checks)


def _check(stmt: ast.Assert, steps: list[tuple[str, str]]) -> Check:
    test = stmt.test
    check = Check(line=stmt.lineno, text=ast.unparse(test))
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        check.op = type(test.ops[0])
        check.left_value, check.left_step = _side(test.left, steps)
        check.right_value, check.right_step = _side(test.comparators[0], steps)
    else:
        check.left_value, check.left_step = _side(test, steps)
    return check


def _side(node: ast.expr, steps: list[tuple[str, str]]) -> tuple[Any, int]:
    """(the literal's value, -1), or (_MISSING, the index of its value in the results) for an
    expression the sandbox evaluates."""
    try:
        return ast.literal_eval(node), -1
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        steps.append(("eval", ast.unparse(node)))
        return _MISSING, sum(1 for kind, _ in steps if kind == "eval") - 1


def decode(value: Any, depth: int = 0) -> Any:
    """The harness's tagged JSON back into Python data (a JSON list is always a [tag, items] pair)."""
    if depth > MAX_DEPTH:
        raise ValueError("a value nests too deeply")
    if not isinstance(value, list):
        return value
    tag, items = value
    if tag == "bytes":
        return bytes.fromhex(items)
    inner = [decode(item, depth + 1) for item in items]
    if tag == "dict":
        return {k: v for k, v in inner}
    return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "pair": tuple}[tag](inner)


def read_results(stdout_tail: str) -> Optional[list]:
    """The harness's results line (the last one), or None when the tests did not run to their end."""
    lines = [line for line in stdout_tail.splitlines() if line.startswith(RESULTS_PREFIX)]
    if not lines:
        return None
    try:
        results = json.loads(lines[-1][len(RESULTS_PREFIX):])
    except (ValueError, RecursionError):   # cut short, a 4300-digit int, a forged deep nest
        return None
    return results if isinstance(results, list) else None


def score(plan: TestPlan, results: list) -> tuple[bool, str]:
    """(every check passed, why not): compares here the values the sandbox sent back."""
    values = [r for r in results if isinstance(r, list) and len(r) == 2 and r[0] == "value"]
    errors = [r for r in results if isinstance(r, list) and len(r) == 2 and r[0] == "error"]
    for check in plan.checks:
        try:
            left = check.left_value if check.left_step < 0 else decode(values[check.left_step][1])
            right = check.right_value if check.right_step < 0 else (
                decode(values[check.right_step][1]) if check.op is not None else None)
        except IndexError:   # the harness stopped at a step that raised
            reason = f"{errors[0][1]}" if errors else "the tests did not run to the end"
            return False, f"{reason} (tests line {check.line}: {check.text[:120]})"
        except (ValueError, TypeError, KeyError) as err:
            return False, f"tests line {check.line}: a value came back malformed ({err})"
        if not _holds(check, left, right):
            got = repr(left)[:80]
            return False, f"AssertionError: tests line {check.line}: {check.text[:120]} is false (got {got})"
    return True, ""


def _holds(check: Check, left: Any, right: Any) -> bool:
    try:
        return bool(left) if check.op is None else bool(OPERATORS[check.op](left, right))
    except TypeError:   # e.g. 1 < "a": the assert would have raised in the sandbox too
        return False


# Runs in the sandbox after the program. `_plain` never calls into the program's objects: it checks
# exact types with `type(...) is`, and iterates only exact built-in containers.
HARNESS = '''import json as _json, os as _os, sys as _sys

_SCALARS = (type(None), bool, int, float, str)


def _plain(value, depth=0):
    kind = type(value)
    if depth > {max_depth}:
        raise ValueError("nests too deeply")
    if kind in _SCALARS:
        return value
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is dict:
        return ["dict", [["pair", [_plain(k, depth + 1), _plain(v, depth + 1)]] for k, v in dict.items(value)]]
    for tag, exact in (("list", list), ("tuple", tuple), ("set", set), ("frozenset", frozenset)):
        if kind is exact:
            return [tag, [_plain(item, depth + 1) for item in exact.__iter__(value)]]
    raise TypeError(f"{{kind.__name__!r}} is not plain data (None, bool, int, float, str, bytes, list, tuple, "
                    "dict, set): tests compare returned values outside the program")


def _run(program, steps, exec=exec, eval=eval, compile=compile, write=_os.write, flush=_sys.stdout.flush,
         settrace=_sys.settrace, setprofile=_sys.setprofile, exit=_os._exit, dumps=_json.dumps, plain=_plain,
         type=type, BaseException=BaseException):
    program_code = compile(program, "solution.py", "exec")
    codes = [(kind, compile(source, "tests.py", kind)) for kind, source in steps]
    scope = {{"__name__": "__main__"}}
    exec(program_code, scope)
    settrace(None)
    setprofile(None)
    results = []
    for kind, code in codes:
        try:
            if kind == "eval":
                results.append(["value", plain(eval(code, scope))])
            else:
                exec(code, scope)
        except BaseException as err:
            try:
                text = (type(err).__name__ + ": " + str(err))[:300]
            except BaseException:
                text = "error"
            results.append(["error", text if type(text) is str else "error"])
            break
    try:
        line = dumps(results)
    except BaseException as err:
        line = dumps([["error", "the results could not be written: " + type(err).__name__]])
    flush()
    write(1, ("\\n" + {prefix!r} + line + "\\n").encode())
    exit(0)


_run({program!r}, {steps!r})
'''


def harness_script(program: str, plan: TestPlan) -> str:
    """The sandbox script: the program, then the plan's steps, then one results line."""
    return HARNESS.format(max_depth=MAX_DEPTH, prefix=RESULTS_PREFIX, program=program, steps=plan.steps)
