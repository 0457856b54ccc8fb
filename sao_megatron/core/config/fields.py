"""The field helpers every recipe section uses: a documented field with its accepted range, and a check
that raises the one-line ConfigError. Standard library only."""
from __future__ import annotations

from dataclasses import field

from .errors import ConfigError


def doc(default, text: str, bounds: str = ""):
    """A dataclass field with a default, a docstring and the values check() accepts, shown by
    --help-recipe: ``bounds`` is ">= 1", "> 0", or an interval such as "[0, 1]" or "(0, 1]" (None,
    where the type allows it, means unset). tests/unit/core/test_recipe_help.py holds check() to it."""
    meta = {"doc": text, "bounds": bounds} if bounds else {"doc": text}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def require(cond: bool, name: str, problem: str, fix: str) -> None:
    if not cond:
        raise ConfigError(name, problem, fix)
