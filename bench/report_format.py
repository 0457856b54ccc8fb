"""Markdown pieces every report section uses: tables, mean +- std, code blocks, target verdicts."""
from __future__ import annotations

import math


def code_block(text: str) -> str:
    return f"```\n{text.strip()}\n```"


def pm(mean, std, digits: int = 3) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "n/a"
    return f"{mean:.{digits}f} +- {std:.{digits}f}"


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def task_order(algos: dict) -> list[str]:
    """The tasks of an algorithms result in the order its command named them (task_runs), then any
    other task its table holds, sorted."""
    held = {key.split("/")[0] for key in algos.get("table", {})}
    named = [t for t in algos.get("task_runs", {}) if t in held]
    return named + sorted(held - set(named))
