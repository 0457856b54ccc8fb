"""The CPU-side logic of the GPU check kit's speed probe (bench/speed_probe.py; the GPU run is
tests/gpu/test_speed_probe.py): both sides train on the same samples and report tokens/s and TFLOP/s from
one FLOP count; the kit carries the record in gpu-check.json, never a stale one, and does not require it."""
from __future__ import annotations

import json

import pytest

TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=512, vocab_size=128)


def test_probe_measures_both_sides_on_the_same_tokens_and_flops(tmp_path):
    from bench.speed_probe import make_model, measure

    model_dir = make_model(tmp_path / "m", shape=TINY, dtype="fp32")
    result = measure(str(model_dir), steps=1, dtype="fp32", n=6, max_response=40, budget=128)
    assert result["device"] == "cpu" and result["flops_per_step"] > 0 and result["tokens_per_step"] > 6 * 16
    for side in ("trainer", "hf"):
        mean = sum(result[side]["seconds_per_step"]) / len(result[side]["seconds_per_step"])
        assert result[side]["tokens_per_s"] == pytest.approx(result["tokens_per_step"] / mean)
        assert result[side]["tflops"] == pytest.approx(result["flops_per_step"] / mean / 1e12)
    assert result["trainer_vs_hf_tokens_per_s"] == pytest.approx(
        result["trainer"]["tokens_per_s"] / result["hf"]["tokens_per_s"])


def test_kit_carries_the_record_and_does_not_require_it(tmp_path):
    from launch.gpu_check import REQUIRED, SPEED_PROBE, speed_probe

    assert speed_probe(tmp_path) is None
    (tmp_path / SPEED_PROBE).write_text(json.dumps({"trainer": {"tokens_per_s": 1.0}}))
    assert speed_probe(tmp_path) == {"trainer": {"tokens_per_s": 1.0}}
    (tmp_path / SPEED_PROBE).write_text("{not json")
    assert speed_probe(tmp_path) is None
    assert not any("speed_probe" in name for name in REQUIRED)
