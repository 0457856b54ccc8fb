"""The one error type a recipe can raise: it names the field and the fix."""
from __future__ import annotations


class ConfigError(ValueError):
    """A recipe is invalid. ``str(err)`` is one line: ``<field>: <problem>; fix: <fix>``."""

    def __init__(self, field: str, problem: str, fix: str):
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}; fix: {fix}")
