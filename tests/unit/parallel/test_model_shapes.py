"""Parameter counts of the shape presets against the table in docs/cluster.md ("Model shapes"; to the
parameter where the table gives one, else to its 0.01B rounding), and against a real HF model's tensors."""
from __future__ import annotations

import json

import pytest

from parallel.model_shapes import SHAPES, count_parameters, get_shape, is_moe_layer, layer_params

# name: (total no MTP, total with MTP, active without emb/head, active with emb/head), in billions.
TABLE = {
    "qwen3-30b-a3b": (30.53, 30.53, 2.73, 3.35),
    "glm4.5-355b-a32b": (352.80, 356.79, 32.08, 33.63),
    "glm4.5-air": (106.85, 109.23, 12.18, 13.42),
    "glm5-744b-a40b": (743.91, 753.86, 39.88, 41.78),
    "deepseek-v3": (671.03, 682.64, 35.70, 37.55),
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_counts_match_the_notes_table(name):
    cfg = get_shape(name)
    plain, with_mtp = count_parameters(cfg), count_parameters(cfg, include_mtp=True)
    got = (plain.total, with_mtp.total, plain.active_without_embeddings, plain.active)
    for value, expected in zip(got, TABLE[name]):
        assert round(value / 1e9, 2) == expected


def test_glm51_with_mtp_equals_the_weight_dump_to_the_parameter():
    assert count_parameters(get_shape("glm5-744b-a40b"), include_mtp=True).total == 753_864_139_008


def test_qwen3_30b_exact_total():
    # 2·V·H + 48·(attention 18,874,368 + qk norms 256 + MoE 604,241,920 + norms 4,096) + final norm
    assert count_parameters(get_shape("qwen3-30b-a3b")).total == 30_532_122_624


def test_dense_and_moe_layers_follow_first_k_dense_replace():
    cfg = get_shape("glm5-744b-a40b")
    assert [is_moe_layer(cfg, i) for i in range(4)] == [False, False, False, True]
    assert layer_params(cfg, 0).dense_mlp == 3 * 6144 * 12288 and layer_params(cfg, 0).routed_experts == 0
    assert layer_params(cfg, 3).routed_experts == 256 * 3 * 6144 * 2048
    # DSA indexer, notes: qr·32·128 + H·128 + H·32 + 256 = 9.37 M per layer
    assert layer_params(cfg, 0).indexer == 2048 * 32 * 128 + 6144 * 128 + 6144 * 32 + 256


def test_unknown_shape_names_the_known_ones():
    with pytest.raises(KeyError, match="glm5-744b-a40b"):
        get_shape("glm-6")


def test_presets_are_copies():
    get_shape("qwen3-30b-a3b")["hidden_size"] = 1
    assert SHAPES["qwen3-30b-a3b"]["hidden_size"] == 2048


def test_tiny_hf_model_tensor_count_matches(tiny_model_dir):
    import torch
    import transformers

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert count_parameters(cfg).total == sum(p.numel() for p in model.parameters())
