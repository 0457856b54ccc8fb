"""The GPU check kit's speed probe (bench/speed_probe.py; not among launch/gpu_check.py's REQUIRED checks):
the trainer's bf16 train tokens/s and TFLOP/s against a plain HF transformers training step on the mid-size
MoE (`MID`), one GPU, written to speed-probe.json beside the kit's gpu-check.json, which carries it. A speed
is recorded, never asserted against a limit: the test fails only if a side does not run.
CUDA only (auto-skipped elsewhere by tests/conftest.py)."""
from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.gpu


def test_trainer_vs_hf_train_speed_on_a_mid_size_moe(tmp_path):
    from bench.speed_probe import make_model, measure
    from launch.gpu_check import SPEED_PROBE, out_dir

    model_dir = make_model(tmp_path / "mid")
    result = measure(str(model_dir), steps=3, dtype="bf16")
    (out_dir() / SPEED_PROBE).write_text(json.dumps(result, indent=1) + "\n")
    for side in ("trainer", "hf"):
        assert math.isfinite(result[side]["tokens_per_s"]) and result[side]["tokens_per_s"] > 0
