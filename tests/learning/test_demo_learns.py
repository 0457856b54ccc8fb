"""`make demo` learns the task: the demo recipe (recipes/tiny_sft_sao_cpu.toml: SFT, then SAO) raises
rollout/accuracy by at least 20 points from its first 10 RL steps to its last 10 (issue 19's target),
and the console says so. Run exactly as `make demo` runs it (one OpenMP thread per process); seeds 1-5
measured +24 to +37 points (docs/results.md), the recipe's seed 1 +34.5 from a fresh clone."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys

from bench import REPO

RECIPE = REPO / "recipes" / "tiny_sft_sao_cpu.toml"


def test_the_demo_raises_accuracy_by_twenty_points_and_prints_it(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-m", "sao_megatron.cli.main", "train", str(RECIPE),
                           f"run.output_dir='{tmp_path}'", f"model.path='{tmp_path / 'model'}'", "logging.wandb=false",
                           "logging.plot=false", "checkpoint.interval=0"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "tiny-sft-sao" / "metrics.jsonl").read_text().splitlines() if line]
    accuracy = [r["rollout/accuracy"] for r in rows if r.get("step", 0) > 0 and "rollout/accuracy" in r]
    assert len(accuracy) == 210                                  # 10 critic warm-up + 200 policy steps
    first, last = statistics.fmean(accuracy[:10]), statistics.fmean(accuracy[-10:])
    assert last - first >= 0.20, f"accuracy {first:.3f} -> {last:.3f}: below the demo's +20 points"
    said = re.search(r"accuracy: first 10 steps ([0-9.]+) -> last 10 steps ([0-9.]+) \(\+([0-9.]+) points\)",
                     proc.stdout + proc.stderr)
    assert said, (proc.stdout + proc.stderr)[-2000:]
    assert float(said.group(1)) == round(first, 3) and float(said.group(2)) == round(last, 3)
