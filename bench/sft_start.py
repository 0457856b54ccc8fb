"""The SFT start the learning benchmarks train from, as the SAO paper's RL starts from an SFT model.

`sao sft recipes/tiny_sft_sao_cpu.toml` (the demo's SFT: the tiny Qwen3-MoE, random init, then
`sft.steps` steps of cross-entropy on chain:1:1's reference answers) is run once per out dir; every
RL run of `sao bench algorithms|stability|online` then starts from that one model, so the methods
differ only in what RL does after it. A model whose marker matches is reused (an earlier benchmark of
the same `sao bench all` made it).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

from bench.training_runs import SFT_DEMO, run_env

TASK = "chain:1:1"   # the demo's task: one-digit a+b / a-b, answers 0-18


def sft_start(out_dir: Path, quick: bool = False, timeout_s: float = 3600.0, recipe: Path = SFT_DEMO,
              overrides: tuple = (), name: str = "sft_start", steps: Optional[int] = None) -> Path:
    """The SFT model directory under out_dir/NAME (made here when missing or stale). `recipe` and
    `overrides` (e.g. another rollout.task) make the start of another task; each task has its own NAME.
    `steps`: SFT steps (default the recipe's sft.steps; quick: 2)."""
    root = Path(out_dir).resolve() / name
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    steps = 2 if quick else steps or _recipe_sft_steps(recipe)
    marker = model / "sao_sft.json"
    if marker.is_file() and json.loads(marker.read_text()).get("sft", {}).get("steps") == steps:
        return model                      # made by an earlier benchmark of this out dir
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "sft", str(recipe), "run.name='sft-start'",
           f"run.output_dir='{root}'", f"model.path='{root / 'base'}'", f"sft.output='{model}'",
           "logging.wandb=false", "logging.console=false", "logging.plot=false", "run.seed=1"]
    cmd += [f"sft.steps={steps}", *overrides]
    log = root / "sft.log"
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=root, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s, env=run_env())
    if proc.returncode != 0 or not (model / "config.json").is_file():
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"the SFT start failed (exit {proc.returncode}); log {log}:\n{tail}")
    return model


def _recipe_sft_steps(recipe: Path = SFT_DEMO) -> int:
    import tomllib

    return int(tomllib.loads(recipe.read_text())["sft"]["steps"])


def sft_info(model: Path, recipe: Path = SFT_DEMO, task: str = TASK) -> dict:
    """What the start model was trained with (its marker), for the report."""
    marker = model / "sao_sft.json"
    info = json.loads(marker.read_text()) if marker.is_file() else {}
    sft = info.get("sft", {})
    return {"recipe": str(recipe.relative_to(recipe.parents[1])), "sft_steps": sft.get("steps"),
            "sft_lr": sft.get("lr"), "sft_batch_size": sft.get("batch_size"), "task": task}


def from_sft(model: Path) -> list[str]:
    """Overrides that make `sao train` on the demo recipe start RL from the SFT model."""
    return [f"model.path='{model}'", "model.init_preset=''", "sft.steps=0"]
