"""Field ranges: the ``bounds`` text a schema field documents is the range its section's check() enforces.

One parser for both readers: ``sao train --help-recipe`` prints the text, ``check_bounds`` refuses a
value outside it with a one-line ConfigError naming the field and the accepted range. Every int and
float field of every section carries bounds (tests/faults/test_recipe_ranges.py holds the schema to it),
so a value such as lr = 1e308 or adam_beta1 = 1.5 stops before anything starts. Standard library only.
"""
from __future__ import annotations

import dataclasses
import re

from .errors import ConfigError

_BOUND = re.compile(r"^(>=|>)\s*(-?[\d.e+-]+)$")
_INTERVAL = re.compile(r"^([\[(])\s*(-?[\d.e+-]+)\s*,\s*(-?[\d.e+-]+)\s*([\])])$")


def parse_bounds(text: str) -> tuple[float, bool, float, bool]:
    """'>= 1' | '> 0' | '[0, 1)' ... -> (low, low inclusive, high, high inclusive); +-inf when open-ended."""
    match = _BOUND.match(text)
    if match:
        return float(match[2]), match[1] == ">=", float("inf"), False
    match = _INTERVAL.match(text)
    if not match:
        raise ValueError(f"bounds {text!r}: write '>= a', '> a' or an interval like '[a, b)'")
    return float(match[2]), match[1] == "[", float(match[3]), match[4] == "]"


def within(value: float, text: str) -> bool:
    low, low_in, high, high_in = parse_bounds(text)
    above = value > low or (low_in and value == low)
    below = value < high or (high_in and value == high)
    return above and below


def check_bounds(section, prefix: str) -> None:
    """Raise ConfigError for the first field of `section` whose value lies outside its documented bounds
    (None, where the type allows it, means unset and is not checked)."""
    for f in dataclasses.fields(section):
        text = f.metadata.get("bounds")
        value = getattr(section, f.name)
        if not text or value is None or isinstance(value, bool):
            continue
        if not within(value, text):
            raise ConfigError(f"{prefix}.{f.name}", f"{value!r} is outside the accepted range {text}",
                              f"use a value {_describe(text)} (default {_default(f)!r})")


def _describe(text: str) -> str:
    return f"in {text}" if text[0] in "[(" else text


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
