"""The MetricSink seam: wandb (offline unless a key is set), a jsonl file that always exists, a console bar,
TensorBoard event files (tensorboard.py).

Metric names follow the field's conventions: train/pg_clipfrac, train/ppo_kl, train/entropy,
train/train_rollout_logprob_abs_diff, critic/vf_explained_var, rollout/raw_reward,
rollout/response_len, rollout/staleness_mean, perf/step_time_s, ...
"""
from __future__ import annotations

import abc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any


def _to_float(value: Any):
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


class JsonlSink(MetricSink):
    """runs/<name>/metrics.jsonl: one object per step with a `step` key. Appends on resume."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)

    def log(self, metrics, step):
        row = {"step": step, "time": time.time()}
        for key, value in metrics.items():
            number = _to_float(value)
            row[key] = number if number is not None else (value if isinstance(value, str) else None)
        self._file.write(json.dumps(row) + "\n")

    def close(self):
        self._file.close()


class WandbSink(MetricSink):
    """wandb, offline by default: online only when WANDB_API_KEY is set (or mode says so)."""

    def __init__(self, project: str, name: str, run_dir: Path, config: dict, mode: str = "auto",
                 resume_id: str = "", entity: str = "", group: str = "", tags: tuple = (), notes: str = ""):
        try:
            import wandb
        except ImportError as err:
            raise ImportError("wandb is not installed: pip install wandb (or set logging.wandb = false)") from err
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        wandb_dir = Path(run_dir) / "wandb"
        wandb_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_DIR", str(wandb_dir))
        os.environ.setdefault("WANDB_CACHE_DIR", str(wandb_dir / "cache"))
        self._wandb = wandb
        self._run = wandb.init(project=project, name=name, dir=str(wandb_dir), config=config, mode=mode,
                               id=resume_id or None, resume="allow" if resume_id else None,
                               entity=entity or None, group=group or None, tags=list(tags) or None,
                               notes=notes or None)
        self.mode = mode

    def log(self, metrics, step):
        clean = {k: v for k, v in ((k, _to_float(v)) for k, v in metrics.items()) if v is not None}
        self._run.log(clean, step=step)

    @property
    def run_id(self) -> str:
        return self._run.id

    def close(self):
        self._run.finish()


class ConsoleSink(MetricSink):
    """A one-line progress bar with the key numbers, redrawn each step (plain lines when not a TTY)."""

    KEYS = [("train/sft_loss", "sft_loss", "{:.3f}"), ("rollout/raw_reward", "reward", "{:.3f}"),
            ("rollout/accuracy", "acc", "{:.3f}"), ("critic/vf_loss", "vf_loss", "{:.4f}"),
            ("critic/value0_return_corr", "v0~R", "{:+.2f}"), ("train/pg_clipfrac", "clip", "{:.3f}"),
            ("rollout/staleness_mean", "stale", "{:.2f}"), ("perf/step_time_s", "s/step", "{:.2f}")]
    SUMMARY = ("rollout/accuracy", "rollout/raw_reward")   # first-10 vs last-10 means, printed at close
    WINDOW = 10

    def __init__(self, total_steps: int, stream=None):
        self.total = max(total_steps, 1)
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.history: dict[str, list[float]] = {key: [] for key in self.SUMMARY}

    def log(self, metrics, step):
        for key in self.SUMMARY:
            value = _to_float(metrics.get(key))
            if value is not None:
                self.history[key].append(value)
        done = min(step, self.total)
        width = 24
        filled = int(width * done / self.total)
        parts = [f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total}"]
        for key, label, fmt in self.KEYS:
            value = _to_float(metrics.get(key))
            if value is not None:
                parts.append(f"{label} {fmt.format(value)}")
        line = "  ".join(parts)
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\n")
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


class MultiSink(MetricSink):
    def __init__(self, sinks: list[MetricSink]):
        self.sinks = sinks

    def log(self, metrics, step):
        for sink in self.sinks:
            sink.log(metrics, step)

    @property
    def run_id(self) -> str:
        return next((s.run_id for s in self.sinks if s.run_id), "")

    def close(self):
        for sink in self.sinks:
            sink.close()


def build_metric_sink(logging_cfg, run_name: str, run_dir: Path, total_steps: int, config: dict,
                      resume_id: str = "") -> MultiSink:
    """jsonl always; wandb, TensorBoard and console as the recipe's logging section says."""
    sinks: list[MetricSink] = [JsonlSink(Path(run_dir) / "metrics.jsonl")]
    if logging_cfg.wandb and logging_cfg.wandb_mode != "disabled":
        sinks.append(WandbSink(logging_cfg.wandb_project, run_name, run_dir, config,
                               mode=logging_cfg.wandb_mode, resume_id=resume_id, entity=logging_cfg.wandb_entity,
                               group=logging_cfg.wandb_group, tags=tuple(logging_cfg.wandb_tags),
                               notes=logging_cfg.wandb_notes))
    if logging_cfg.tensorboard:
        from .tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(Path(run_dir) / "tensorboard"))
    if logging_cfg.console:
        sinks.append(ConsoleSink(total_steps))
    return MultiSink(sinks)
