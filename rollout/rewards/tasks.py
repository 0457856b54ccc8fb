"""Locally generated tasks and their checkers: arithmetic, chain (with a difficulty knob), countdown,
copy, digits.

Each task makes problems from a seeded RNG (no download) and scores a response in [0, 1]; `exact`
says whether a response is exactly correct (the rollout/accuracy metric), and `solution` gives the
reference response that `sao sft` trains on. They are
sized for the tiny char-level model (one token per character, ~8-32 new tokens): answers are short
and the scores give partial credit, so a randomly initialised policy sees a non-zero reward signal
from its first samples and RL can climb from there.

Scores (r = response with surrounding whitespace stripped):
- arithmetic ("a+b=" / "a-b=", answer a single digit 0-9):
  1.0 if r == answer; 0.5 if r starts with the answer (right digit, trailing text);
  0.1 if r starts with another digit (the format is right); else 0.
- chain ("chain:K:D": K chained + / - operations on numbers of up to D digits, e.g. "chain:2:1" ->
  "7+5-3="; every partial result stays >= 0; "chain" alone is chain:1:1; "chain:K:D:train" and
  "chain:K:D:eval" draw only from one side of the held-out split below, plain "chain:K:D" from both):
  1.0 if r == answer; else, when r is a number, 0.5 * (characters equal at equal positions) /
  max(len(r), len(answer)); else 0. Raising K or D lengthens the answer and the work, so the family
  keeps headroom for a model that has mastered an easier level.
- countdown (reach `target` with + - * and each given number at most once):
  1.0 if the expression is valid and equals target; 0.1 if it is a valid expression over the
  allowed numbers with another value; else 0.
- copy (reverse a short lowercase string): matching characters at equal positions divided by
  max(len(r), len(target)), so extra or missing characters cost credit.
- scratch ("scratch:K", K in 3..6 chained + / - operations on one-digit numbers, e.g. "7+5-3+2="): a long
  horizon with a sparse reward. The reference response writes every partial result, then the answer
  after "|" ("7+5=12,12-3=9,9+2=11|11": 20-40 characters at K=4); the score is 1.0 when the text after
  the last "|" is the answer and 0 otherwise, whatever the scratchpad says. "scratch:K" draws only
  training problems, "scratch:K:eval" only held-out ones, so an evaluation never sees a training prompt.
  The held-out split (scratch and chain): a stable hash of the problem's text puts one problem in
  EVAL_SHARE on the eval side (heldout_split).
- digits (the prompt is one lowercase letter, "x:"; answer in digits): the fraction of r's characters
  that are digits, 0 for an empty r. The online environment's first phase held fixed: a style the
  tiny model learns within tens of steps, so algorithms can be compared on how fast they learn it.
"""
from __future__ import annotations

import ast
import random
import re
import string
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Problem:
    text: str          # the user message
    label: Any         # JSON-safe answer the checker uses
    metadata: dict


def make_arithmetic(rng: random.Random) -> Problem:
    """a+b or a-b with a single-digit, non-negative result."""
    answer = rng.randrange(10)
    if rng.random() < 0.5:
        a = rng.randrange(answer + 1)
        text = f"{a}+{answer - a}="
    else:
        b = rng.randrange(10 - answer)
        text = f"{answer + b}-{b}="
    return Problem(text, str(answer), {"task": "arithmetic"})


def score_arithmetic(response: str, label: str) -> float:
    r = response.strip()
    if r == label:
        return 1.0
    if r.startswith(label):
        return 0.5
    if r[:1].isdigit():
        return 0.1
    return 0.0


def make_chain(rng: random.Random, ops: int = 1, digits: int = 1, split: str = "") -> Problem:
    """`ops` chained + / - operations on numbers below 10**digits; no partial result is negative.
    `split` 'train' / 'eval' draws from that side of heldout_split only ('' = both)."""
    top = 10 ** digits
    while True:                        # with a split, about 1 draw in 5 is eval: a few tries find the wanted side
        total = rng.randrange(top)
        text = str(total)
        for _ in range(ops):
            if total > 0 and rng.random() < 0.5:
                n = rng.randrange(min(total, top - 1) + 1)
                total, text = total - n, f"{text}-{n}"
            else:
                n = rng.randrange(top)
                total, text = total + n, f"{text}+{n}"
        if not split or heldout_split(text) == split:
            metadata = {"task": f"chain:{ops}:{digits}", **({"split": split} if split else {})}
            return Problem(f"{text}=", str(total), metadata)


def score_chain(response: str, label: str) -> float:
    r = response.strip()
    if r == label:
        return 1.0
    if not re.fullmatch(r"-?[0-9]+", r):
        return 0.0
    same = sum(a == b for a, b in zip(r, label))
    return 0.5 * same / max(len(r), len(label))


EVAL_SHARE = 5          # one problem in 5 (by a hash of its text) is held out for evaluation
SCRATCH_OPS = range(3, 7)


def heldout_split(text: str) -> str:
    """'eval' or 'train' for a problem's text (without its '='): a stable hash (crc32), the same on every
    machine."""
    return "eval" if zlib.crc32(text.encode()) % EVAL_SHARE == 0 else "train"


def make_scratch(rng: random.Random, ops: int = 4, split: str = "train") -> Problem:
    """`ops` chained + / - on one-digit numbers (no partial result negative), drawn from `split` only."""
    while True:                        # about 1 draw in 5 is eval: a few tries find the wanted split
        total, text, steps = rng.randrange(10), "", []
        text = str(total)
        for _ in range(ops):
            if total > 0 and rng.random() < 0.5:
                n = rng.randrange(min(total, 9) + 1)
                steps.append(f"{total}-{n}={total - n}")
                total, text = total - n, f"{text}-{n}"
            else:
                n = rng.randrange(10)
                steps.append(f"{total}+{n}={total + n}")
                total, text = total + n, f"{text}+{n}"
        if heldout_split(text) == split:
            return Problem(f"{text}=", ",".join(steps) + f"|{total}", {"task": f"scratch:{ops}", "split": split})


def score_scratch(response: str, label: str) -> float:
    """1.0 when the text after the response's last '|' is the label's answer; the scratchpad earns nothing."""
    if "|" not in response:
        return 0.0
    return 1.0 if response.rsplit("|", 1)[1].strip() == label.rsplit("|", 1)[1] else 0.0


def scratch_task(ops: int = 4, split: str = "train") -> Task:
    if ops not in SCRATCH_OPS or split not in ("train", "eval"):
        raise ValueError(f"rollout.task: scratch:{ops}{':' + split if split != 'train' else ''} is out of range; "
                         f"use scratch:K or scratch:K:eval with K in {SCRATCH_OPS.start}..{SCRATCH_OPS.stop - 1}")
    suffix = ":eval" if split == "eval" else ""
    return Task(f"scratch:{ops}{suffix}", lambda rng: make_scratch(rng, ops, split), score_scratch)


def make_countdown(rng: random.Random, count: int = 3) -> Problem:
    """`count` numbers in 1..9 and a target reached by one random expression over them."""
    numbers = [rng.randint(1, 9) for _ in range(count)]
    expr = str(numbers[0])
    for n in numbers[1:]:
        expr = f"{expr}{rng.choice('+-*')}{n}"
    target = _eval_arith(expr)
    shown = sorted(numbers)
    text = f"use {' '.join(map(str, shown))} to make {target}:"
    return Problem(text, {"numbers": shown, "target": target}, {"task": "countdown"})


_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult,
                  ast.USub)


def _eval_arith(expr: str) -> int:
    """Evaluate an integer expression of + - * and parentheses; ValueError on anything else."""
    if not re.fullmatch(r"[0-9+\-*() ]{1,64}", expr):
        raise ValueError(f"not an arithmetic expression: {expr!r}")
    tree = ast.parse(expr, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise ValueError(f"disallowed syntax {type(node).__name__} in {expr!r}")
    return int(eval(compile(tree, "<countdown>", "eval"), {"__builtins__": {}}))  # checked AST only


def score_countdown(response: str, label: dict) -> float:
    expr = response.strip().split("=")[0].strip()
    try:
        value = _eval_arith(expr)
    except (ValueError, SyntaxError):
        return 0.0
    used = Counter(int(n) for n in re.findall(r"\d+", expr))
    if used - Counter(label["numbers"]):
        return 0.0          # a number not offered, or used more often than offered
    return 1.0 if value == label["target"] else 0.1


def make_copy(rng: random.Random, min_len: int = 2, max_len: int = 4) -> Problem:
    word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(min_len, max_len)))
    return Problem(f"reverse {word}:", word[::-1], {"task": "copy"})


def score_copy(response: str, label: str) -> float:
    r = response.strip()
    if not r and not label:
        return 1.0
    same = sum(a == b for a, b in zip(r, label))
    return same / max(len(r), len(label))


STYLES: dict[str, str] = {"digits": string.digits, "capitals": string.ascii_uppercase,
                          "punctuation": string.punctuation}


def style_score(response: str, style: str) -> float:
    """Fraction of the stripped response's characters in the style's class (0 when empty)."""
    r = response.strip()
    return sum(ch in STYLES[style] for ch in r) / len(r) if r else 0.0


def make_digits(rng: random.Random) -> Problem:
    return Problem(f"{rng.choice(string.ascii_lowercase)}:", "digits", {"task": "digits"})


def _stripped_equal(response: str, label: Any) -> bool:
    return response.strip() == str(label)


def _countdown_solution(label: dict) -> str:
    raise ValueError("task countdown has no stored reference solution; use a jsonl of prompt/response pairs")


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[random.Random], Problem]
    score: Callable[[str, Any], float]
    exact: Optional[Callable[[str, Any], bool]] = None      # None: exactly correct means score == 1.0
    solution: Callable[[Any], str] = str                     # label -> the reference response

    def is_exact(self, response: str, label: Any) -> bool:
        if self.exact is not None:
            return self.exact(response, label)
        return self.score(response, label) >= 1.0


TASKS: dict[str, Task] = {
    "arithmetic": Task("arithmetic", make_arithmetic, score_arithmetic, _stripped_equal),
    "countdown": Task("countdown", make_countdown, score_countdown, solution=_countdown_solution),
    "copy": Task("copy", make_copy, score_copy, _stripped_equal),
    "digits": Task("digits", make_digits, style_score, solution=lambda label: "7"),
}
MAX_CHAIN_OPS, MAX_CHAIN_DIGITS = 8, 6


def chain_task(ops: int = 1, digits: int = 1, split: str = "") -> Task:
    if not (1 <= ops <= MAX_CHAIN_OPS and 1 <= digits <= MAX_CHAIN_DIGITS):
        raise ValueError(f"rollout.task: chain:{ops}:{digits} is out of range; use chain:K:D with K in "
                         f"1..{MAX_CHAIN_OPS} operations and D in 1..{MAX_CHAIN_DIGITS} digits")
    name = f"chain:{ops}:{digits}" + (f":{split}" if split else "")
    return Task(name, lambda rng: make_chain(rng, ops, digits, split), score_chain, _stripped_equal)


def get_task(name: str) -> Task:
    """A built-in task by name; "chain:K:D" picks the chain family's difficulty (K ops, D digits)."""
    if name == "chain" or name.startswith("chain:"):
        return chain_task(*_chain_level(name))
    if name == "scratch" or name.startswith("scratch:"):
        parts = name.split(":")[1:]
        if len(parts) > 2 or (parts and not parts[0].isdigit()) or (len(parts) == 2 and parts[1] != "eval"):
            raise ValueError(f"rollout.task: {name!r} is not scratch:K or scratch:K:eval; write e.g. scratch:4")
        return scratch_task(int(parts[0]) if parts else 4, "eval" if len(parts) == 2 else "train")
    if name not in TASKS:
        raise ValueError(f"rollout.task: unknown task {name!r}; use one of {sorted(TASKS)}, chain:K:D[:train|:eval], scratch:K[:eval] "
                         "or 'online'")
    return TASKS[name]


def _chain_level(name: str) -> tuple[int, int, str]:
    """(ops, digits, split) of 'chain', 'chain:K', 'chain:K:D' or 'chain:K:D:train|eval'."""
    parts = name.split(":")[1:]
    split = parts.pop() if len(parts) == 3 and parts[2] in ("train", "eval") else ""
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"rollout.task: {name!r} is not chain:K:D[:train|:eval]; write e.g. chain:2:1 "
                         "(2 operations, 1-digit numbers) or chain:2:1:eval (its held-out problems)")
    ops = int(parts[0]) if parts else 1
    digits = int(parts[1]) if len(parts) > 1 else 1
    return ops, digits, split
