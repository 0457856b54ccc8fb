"""The console of a run: its start-up phases, then one line per step with tokens/s and the time left.

On a terminal (stderr and stdout both TTYs) rich draws a spinner while a start-up phase runs and a
progress bar under the step lines; anywhere else (CI, `| tee`, a log file) each phase and each step is
one plain line, so logs stay greppable. metrics.jsonl is written whatever the console does (sinks.py).

Megatron-Core warns once per module that Transformer Engine and Apex are missing (seven warnings on a
CPU run: megatron/core/optimizer/__init__.py:24, models/backends.py:21, ...); `quiet_missing_kernel_warnings`
hides them in a run, and `sao doctor` says what they mean.
"""
from __future__ import annotations

import contextlib
import sys
import time
import warnings
from typing import Optional

from .seam import MetricSink, to_float

# The text of Megatron-Core 0.16.1's warnings when TE/Apex are absent ("Transformer Engine and Apex are not
# installed. Falling back to ...", "Apex is not installed. Falling back to Torch Norm").
MISSING_KERNEL_WARNINGS = r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed"


def quiet_missing_kernel_warnings() -> None:
    """Hide Megatron's missing-TE/Apex warnings in this process (`sao doctor` explains them)."""
    warnings.filterwarnings("ignore", message=MISSING_KERNEL_WARNINGS)


def missing_kernels_note(cuda: bool) -> str:
    """One line for a GPU run without Transformer Engine (slower kernels, no FP8), else ''. On a CPU the
    local kernels are the expected path and nothing is said."""
    import importlib.util

    if not cuda or importlib.util.find_spec("transformer_engine") is not None:
        return ""
    return ("sao: Transformer Engine is not installed: Megatron runs its local kernels on this GPU (slower, no FP8); "
            "`sao doctor` explains")


def _is_terminal(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)()) and sys.stdout.isatty()


class StartupPhases:
    """`with phases.phase("building models"):` -> a spinner on a terminal, else a plain line; the phase's
    seconds when it ends. `enabled` False (logging.console off, ranks other than 0) prints nothing."""

    def __init__(self, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = _is_terminal(self.stream)

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        started = time.monotonic()
        if self.tty:
            from rich.console import Console

            console = Console(file=self.stream)
            with console.status(f"{name} ..."):
                yield
            console.print(f"[green]done[/green] {name} ({time.monotonic() - started:.1f} s)")
            return
        self._line(f"sao: {name} ...")
        yield
        self._line(f"sao: {name} done ({time.monotonic() - started:.1f} s)")

    def note(self, text: str) -> None:
        """A one-line remark among the phases (nothing when disabled or empty)."""
        if self.enabled and text:
            self._line(text)

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()


class ConsoleSink(MetricSink):
    """One line per step with the key numbers, tokens/s and the time left; under it a rich progress bar on
    a terminal. Steps before the first (value pretraining: negative steps) print without the bar."""

    KEYS = [("train/sft_loss", "sft_loss", "{:.3f}"), ("rollout/raw_reward", "reward", "{:.3f}"),
            ("rollout/accuracy", "acc", "{:.3f}"), ("critic/vf_loss", "vf_loss", "{:.4f}"),
            ("critic/value0_return_corr", "v0~R", "{:+.2f}"), ("train/pg_clipfrac", "clip", "{:.3f}"),
            ("train/ref_kl", "kl", "{:.4f}"), ("rollout/staleness", "stale", "{:.2f}"),
            ("perf/step_time_s", "s/step", "{:.2f}"), ("perf/tokens_per_s", "tok/s", "{:.0f}")]
    SUMMARY = ("rollout/accuracy", "rollout/raw_reward")   # first-10 vs last-10 means, printed at close
    WINDOW = 10

    def __init__(self, total_steps: int, stream=None):
        self.total = max(total_steps, 1)
        self.stream = stream or sys.stderr
        self.tty = _is_terminal(self.stream)
        self.history: dict[str, list[float]] = {key: [] for key in self.SUMMARY}
        self.step_times: list[float] = []
        self._progress = self._task = None

    def log(self, metrics, step):
        for key in self.SUMMARY:
            value = to_float(metrics.get(key))
            if value is not None:
                self.history[key].append(value)
        step_time = to_float(metrics.get("perf/step_time_s"))
        if step_time is not None and step > 0:
            self.step_times.append(step_time)
        line = self.line(metrics, step)
        if self.tty:
            self._draw(line, step)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def line(self, metrics: dict, step: int) -> str:
        done = min(max(step, 0), self.total)
        width = 24
        filled = int(width * done / self.total)
        parts = [f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total}"]
        for key, label, fmt in self.KEYS:
            value = to_float(metrics.get(key))
            if value is not None:
                parts.append(f"{label} {fmt.format(value)}")
        left = self.seconds_left(step)
        if left is not None:
            parts.append(f"left {_duration(left)}")
        return "  ".join(parts)

    def seconds_left(self, step: int) -> Optional[float]:
        """Mean of the last WINDOW step times x the steps still to run (None before the first step)."""
        if not self.step_times or step <= 0:
            return None
        recent = self.step_times[-self.WINDOW:]
        return sum(recent) / len(recent) * max(self.total - step, 0)

    def _draw(self, line: str, step: int) -> None:
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(TextColumn("steps"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[left]}"), console=Console(file=self.stream))
            self._task = self._progress.add_task("train", total=self.total, left="")
            self._progress.start()
        left = self.seconds_left(step)
        self._progress.console.print(line, markup=False, highlight=False)
        self._progress.update(self._task, completed=min(max(step, 0), self.total),
                              left="" if left is None else f"{_duration(left)} left")

    def close(self):
        if self._progress is not None:
            self._progress.stop()
        for line in self.summary_lines():
            self.stream.write(line + "\n")

    def summary_lines(self) -> list[str]:
        """'accuracy: first 10 steps 0.131 -> last 10 steps 0.512 (+38.1 points)' per summary metric."""
        lines = []
        for key in self.SUMMARY:
            values, n = self.history[key], self.WINDOW
            if len(values) < 2 * n:
                continue
            first, last = sum(values[:n]) / n, sum(values[-n:]) / n
            lines.append(f"{key.split('/')[-1]}: first {n} steps {first:.3f} -> last {n} steps {last:.3f} "
                         f"({100 * (last - first):+.1f} points)")
        return lines


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")
