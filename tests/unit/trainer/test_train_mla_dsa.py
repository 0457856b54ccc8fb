"""`sao train` end to end on the flagship's class: tiny GLM-5 (MLA + DSA, index_topk 4 < every sequence, a
dense first layer, a shared indexer layer) and tiny DeepSeek-V3 (MLA, group-limited routing) through the
reference server at temperature 0.7, 3 policy steps.

The first policy step trains on samples of weight version 0, so the trainer must see what the engine
saw: its routes and (GLM-5) its indexer selections are replayed; train/route_agreement and
train/indexer_agreement say how many of those choices the trainer would also have made, and the
trainer's logprobs equal the engine's (train/train_rollout_logprob_abs_diff).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "tiny_moe_cpu.toml"


def _train(tmp: Path, arch: str) -> list[dict]:
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "train", str(RECIPE), f"run.output_dir='{tmp}'",
           f"run.name='{arch}'", f"model.path='{tmp / arch}'", f"model.arch='{arch}'", "run.num_steps=3",
           "critic.warmup_steps=0", "rollout.temperature=0.7", "rollout.batch_size=8", "rollout.max_in_flight=8",
           "checkpoint.interval=0", "logging.wandb=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (tmp / arch / "metrics.jsonl").read_text().splitlines() if line]


@pytest.mark.parametrize("arch", ["glm5", "deepseek_v3"])
def test_the_flagship_class_trains_on_what_the_engine_saw(tmp_path, arch):
    rows = _train(tmp_path, arch)
    assert [r["step"] for r in rows] == [1, 2, 3]
    first = rows[0]
    assert first["train/route_agreement"] >= 0.99
    assert first["train/train_rollout_logprob_abs_diff"] <= 1e-3
    if arch == "glm5":
        assert first["train/indexer_agreement"] >= 0.99
    else:
        assert "train/indexer_agreement" not in first
    assert [r["train/lr"] > 0 for r in rows] == [True] * 3     # every step was a policy step
