"""The MetricSink seam: wandb (offline unless a key is set), a jsonl file that always exists, a console bar,
TensorBoard event files (tensorboard.py).

Metric names follow the field's conventions: train/pg_clipfrac, train/ppo_kl, train/entropy,
train/train_rollout_logprob_abs_diff, critic/vf_explained_var, rollout/raw_reward,
rollout/response_len, rollout/staleness, perf/step_time_s, ...
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .console import ConsoleSink   # rich on a terminal, plain lines elsewhere
from .seam import MetricSink, to_float


class JsonlSink(MetricSink):
    """runs/<name>/metrics.jsonl: one object per step with a `step` key. Appends on resume, after
    rewind.py has cut the rows past the resumed step (so no step repeats)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)

    def log(self, metrics, step):
        row = {"step": step, "time": time.time()}
        for key, value in metrics.items():
            number = to_float(value)
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
        clean = {k: v for k, v in ((k, to_float(v)) for k, v in metrics.items()) if v is not None}
        self._run.log(clean, step=step)

    @property
    def run_id(self) -> str:
        return self._run.id

    def close(self):
        self._run.finish()


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
