"""Block-FP8 quantization for FP8 engines (rollout/weights/fp8_blocks.py) against hand-computed blocks,
which tensors are FP8, and the stream/bucket rules that keep a scale with its weight."""
from __future__ import annotations

import pytest
import torch

from rollout.weights.bucketing import iter_buckets
from rollout.weights.fp8_blocks import (E4M3_MAX, Fp8Layout, dequantize_block_fp8, layout_from_quantization_config,
                                        quantize_block_fp8, quantize_stream, round_trip_stream, scale_name)
from rollout.weights.broadcast import non_expert_first


def test_one_partial_block_by_hand():
    """2x3 (one short block): amax 4 -> scale 4/448 = 1/112; q = w * 112, each value exact in e4m3."""
    w = torch.tensor([[1.0, -2.0, 0.5], [4.0, 0.0, -0.25]])
    q, scale = quantize_block_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, 3)
    assert scale.dtype == torch.float32 and scale.shape == (1, 1)
    assert scale.item() == pytest.approx(4 / 448, rel=1e-7)
    assert q.float().tolist() == [[112.0, -224.0, 56.0], [448.0, 0.0, -28.0]]
    assert torch.allclose(dequantize_block_fp8(q, scale, torch.float32), w, rtol=1e-6, atol=0)


def test_the_block_max_maps_to_e4m3_max_and_a_zero_block_gets_scale_one():
    w = torch.zeros(128, 256)
    w[5, 7] = -448.0          # block (0, 0): amax 448 -> scale exactly 1, q = -448
    q, scale = quantize_block_fp8(w)
    assert scale.tolist() == [[1.0, 1.0]]                 # block (0, 1) is all zeros: scale 1, not 0/0
    assert q[5, 7].float().item() == -E4M3_MAX and q.float().abs().sum().item() == E4M3_MAX
    assert torch.equal(dequantize_block_fp8(q, scale, torch.float32), w)


def test_shapes_not_divisible_by_128_have_short_edge_blocks_with_their_own_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(130, 260, generator=g) * 0.01
    w[129, 259] = 3.0         # the corner block (1, 2) holds rows 128..129 and columns 256..259 only
    w[0, 0] = 100.0           # a large value in block (0, 0) must not touch any other block's scale
    q, scale = quantize_block_fp8(w)
    assert scale.shape == (2, 3) and q.shape == (130, 260)
    assert scale[1, 2].item() == pytest.approx(3.0 / 448, rel=1e-7)
    assert scale[0, 0].item() == pytest.approx(100.0 / 448, rel=1e-7)
    for (r, c) in [(0, 1), (0, 2), (1, 0), (1, 1)]:
        block = w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
        assert scale[r, c].item() == pytest.approx(block.abs().max().item() / 448, rel=1e-7)
    back = dequantize_block_fp8(q, scale, torch.float32)
    rep = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :260]
    # e4m3 keeps 3 mantissa bits: |error| <= half an ulp = 2^-4 relative, or half the smallest subnormal step
    bound = torch.maximum(w.abs() / 16, rep * 2.0 ** -10)
    assert ((back - w).abs() <= bound * 1.0001).all()
    assert back[129, 259].item() == 3.0 and back[0, 0].item() == 100.0   # each block's max is exact


def test_bf16_input_and_errors():
    q, scale = quantize_block_fp8(torch.full((3, 4), -0.5, dtype=torch.bfloat16))
    assert q.float().unique().tolist() == [-448.0] and scale.item() == pytest.approx(0.5 / 448)
    assert dequantize_block_fp8(q, scale, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="2-D"):
        quantize_block_fp8(torch.ones(4))
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_block_fp8(torch.tensor([[float("inf")]]))
    with pytest.raises(ValueError, match=r"scale shape \(1, 1\) does not fit weight \(130, 4\)"):
        dequantize_block_fp8(q.new_zeros(130, 4), scale, torch.float32)


FP8 = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
       "model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.self_attn.q_a_proj.weight",
       "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.mlp.down_proj.weight",
       "model.layers.2.mlp.shared_experts.gate_proj.weight", "model.layers.2.mlp.experts.7.up_proj.weight"]
NOT_FP8 = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.2.mlp.gate.weight",
           "model.layers.2.mlp.gate.e_score_correction_bias", "model.layers.0.input_layernorm.weight",
           "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.q_proj.bias",
           "model.layers.1.self_attn.kv_a_layernorm.weight", "model.layers.1.self_attn.indexer.wk.weight"]


def test_which_tensors_an_fp8_engine_holds_in_fp8():
    layout = Fp8Layout()
    assert [n for n in FP8 if not layout.holds_fp8(n)] == []
    assert [n for n in NOT_FP8 if layout.holds_fp8(n)] == []


def test_checkpoint_ignored_layers_as_sglang_matches_them():
    config = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128],
                                      "modules_to_not_convert": ["model.layers.0.self_attn.q_proj", "layers.1.mlp",
                                                                 "model.layers.3.mlp.experts.5.down_proj"]}}
    layout = layout_from_quantization_config(config)
    assert not layout.holds_fp8("model.layers.0.self_attn.q_proj.weight")
    assert layout.holds_fp8("model.layers.0.self_attn.k_proj.weight")
    assert layout.holds_fp8("model.layers.10.self_attn.q_proj.weight")       # dotted boundary: not layers.1
    assert not layout.holds_fp8("model.layers.1.mlp.experts.0.gate_proj.weight")
    # SGLang decides routed experts per MoE layer: one listed expert leaves the layer's experts unquantized
    assert not layout.holds_fp8("model.layers.3.mlp.experts.0.up_proj.weight")
    assert layout.holds_fp8("model.layers.4.mlp.experts.0.up_proj.weight")


@pytest.mark.parametrize("quant, match", [
    ({}, "has no quantization_config"),
    ({"quantization_config": {"quant_method": "mxfp8", "weight_block_size": [1, 32]}}, "'mxfp8' is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, r"weight_block_size None is not \[128, 128\]"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [1, 128]}}, "re-block"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, "not supported"),
])
def test_checkpoints_this_sender_cannot_match_are_refused(quant, match):
    with pytest.raises(ValueError, match=match):
        layout_from_quantization_config(quant, "m/config.json")


def _named():
    g = torch.Generator().manual_seed(1)
    return [("model.embed_tokens.weight", torch.randn(50, 64, generator=g, dtype=torch.bfloat16)),
            ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64, generator=g, dtype=torch.bfloat16)),
            ("model.layers.0.mlp.experts.0.gate_proj.weight", torch.randn(32, 64, generator=g, dtype=torch.bfloat16)),
            ("model.layers.0.mlp.experts.0.down_proj.weight", torch.randn(64, 32, generator=g, dtype=torch.bfloat16)),
            ("model.layers.0.input_layernorm.weight", torch.ones(64, dtype=torch.bfloat16)),
            ("model.layers.0.mlp.experts.1.gate_proj.weight", torch.randn(32, 64, generator=g, dtype=torch.bfloat16))]


def test_stream_sends_each_fp8_weight_followed_by_its_scale_and_the_rest_in_bf16():
    out = list(quantize_stream(_named(), Fp8Layout()))
    names = [n for n, _ in out]
    for weight in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.0.down_proj.weight"):
        assert names[names.index(weight) + 1] == scale_name(weight) == weight + "_scale_inv"
    dtypes = {n: t.dtype for n, t in out}
    assert dtypes["model.embed_tokens.weight"] == dtypes["model.layers.0.input_layernorm.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.float8_e4m3fn
    assert dtypes["model.layers.0.self_attn.q_proj.weight_scale_inv"] == torch.float32
    assert len(out) == 6 + 4
    trip = dict(round_trip_stream(_named(), Fp8Layout()))
    q, s = dict(out)["model.layers.0.self_attn.q_proj.weight"], dict(out)["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert torch.equal(trip["model.layers.0.self_attn.q_proj.weight"], dequantize_block_fp8(q, s, torch.bfloat16))
    assert torch.equal(trip["model.embed_tokens.weight"], _named()[0][1])


def test_a_scale_never_leaves_its_weight_in_buckets_or_the_expert_hold_back():
    out = list(quantize_stream(_named(), Fp8Layout()))
    ordered = list(non_expert_first(out, max_held_bytes=32 * 64))   # one expert weight fills the hold-back
    names = [n for n, _ in ordered]
    for i, name in enumerate(names):
        if name.endswith("_scale_inv"):
            assert names[i - 1] == name[: -len("_scale_inv")]
    for bucket_bytes in (1, 2048, 5000):
        buckets = list(iter_buckets(ordered, bucket_bytes))
        for b in buckets:
            for name in b.names:
                if name.endswith("_scale_inv"):
                    assert name[: -len("_scale_inv")] in b.names
            names_, dtypes, _ = b.meta()
            assert set(dtypes) <= {"float32", "bfloat16", "float8_e4m3fn"}
        assert sum(len(b.names) for b in buckets) == len(ordered)


def test_sao_convert_hf_to_fp8_writes_the_checkpoint_an_fp8_engine_loads(tiny_model_dir, tmp_path, capsys):
    """The converted checkpoint holds what weight sync would send (same quantizer), a quantization_config
    SGLang reads as 128x128 block FP8, and passes the trainer's check as rollout.engine_model_path."""
    import json

    from checkpoints.hf_io import HFCheckpoint
    from sao_megatron.cli.main import main
    from sao_megatron.core.config.recipe import Recipe
    from sao_megatron.trainer.engines import check_engine_can_take_updates, engine_fp8_layout

    out = tmp_path / "fp8"
    assert main(["convert", "hf-to-fp8", str(tiny_model_dir), str(out), "--ignore", "model.layers.0.self_attn.q_proj"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                             "weight_block_size": [128, 128],
                                             "modules_to_not_convert": ["model.layers.0.self_attn.q_proj"]}
    source = list(HFCheckpoint(tiny_model_dir).items())
    layout = engine_fp8_layout_for(out)
    written = dict(HFCheckpoint(out).items())
    expected = dict(quantize_stream(source, layout))
    assert written.keys() == expected.keys() and all(torch.equal(written[n], expected[n]) for n in expected)
    assert written["model.layers.0.self_attn.q_proj.weight"].dtype != torch.float8_e4m3fn   # ignored
    assert written["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert (out / "tokenizer.json").exists() == (tiny_model_dir / "tokenizer.json").exists()
    recipe = Recipe()
    recipe.rollout.engine, recipe.rollout.engine_fp8, recipe.rollout.engine_model_path = "sglang", True, str(out)
    check_engine_can_take_updates(recipe)
    assert engine_fp8_layout(recipe) == layout
    assert main(["convert", "hf-to-fp8", str(out), str(tmp_path / "again")]) == 2   # already quantized
    assert "already has a quantization_config ('fp8')" in capsys.readouterr().err


def engine_fp8_layout_for(path):
    from rollout.weights.fp8_blocks import layout_from_model_dir

    return layout_from_model_dir(path)


def _mla_layer(layer: int):
    g = torch.Generator().manual_seed(layer)
    p = f"model.layers.{layer}.self_attn."
    shapes = [("q_a_proj.weight", (48, 64)), ("q_a_layernorm.weight", (48,)), ("q_b_proj.weight", (96, 48)),
              ("kv_a_proj_with_mqa.weight", (40, 64)), ("kv_a_layernorm.weight", (32,)), ("kv_b_proj.weight", (128, 32)),
              ("o_proj.weight", (64, 64))]
    return [(p + n, torch.randn(s, generator=g, dtype=torch.bfloat16)) for n, s in shapes]


@pytest.mark.parametrize("fp8", [False, True])
def test_mla_q_a_and_kv_a_projections_always_share_an_update_call(fp8):
    """SGLang's DeepSeek loader fuses q_a_proj with kv_a_proj_with_mqa inside one load_weights call and
    drops a half whose partner is in another call: whatever the bucket size, they travel together
    (with their scales for an FP8 engine), and nothing else is lost or reordered across layers."""
    from rollout.weights.buckets import mla_a_pairs

    named = _mla_layer(0) + _mla_layer(1)
    stream = list(mla_a_pairs(named))
    assert sorted(n for n, _ in stream) == sorted(n for n, _ in named)
    names = [n for n, _ in stream]
    for layer in (0, 1):
        q_a = names.index(f"model.layers.{layer}.self_attn.q_a_proj.weight")
        assert names[q_a + 1] == f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"
    if fp8:
        stream = list(quantize_stream(stream, Fp8Layout()))
    for bucket_bytes in (1, 3000, 9000, 20000):
        buckets = list(iter_buckets(stream, bucket_bytes))
        for layer in (0, 1):
            p = f"model.layers.{layer}.self_attn."
            together = [p + "q_a_proj.weight", p + "kv_a_proj_with_mqa.weight"]
            if fp8:
                together += [scale_name(n) for n in together]
            assert sum(all(n in b.names for n in together) for b in buckets) == 1, (bucket_bytes, layer)
