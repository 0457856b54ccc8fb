"""The MetricSink seam itself, apart from its sinks (sinks.py, console.py, tensorboard.py import it from here,
so no sink module imports another to get it)."""
from __future__ import annotations

import abc
import math
from typing import Any


def to_float(value: Any):
    """A finite float, or None for what a sink cannot plot (text, NaN, inf)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class MetricSink(abc.ABC):
    @abc.abstractmethod
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None:
        pass

    @property
    def run_id(self) -> str:
        return ""
