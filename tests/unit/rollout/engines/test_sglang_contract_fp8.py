"""Contract: what the block-FP8 sender (rollout/weights/fp8_blocks.py) assumes about SGLang 0.5.23.

Read from the pinned wheel's sources (tests/support/sglang_wheel.py: downloaded once into
build/sglang_wheel/, SGLang never imported; as the other contract tests, an unreachable registry
fails the test rather than skipping it). Two small pure-torch functions of SGLang are compiled from
that text and run against ours: its block dequantization (the scale convention) and its dotted
module-path match (which layers a checkpoint's ignored_layers leave unquantized).
"""
from __future__ import annotations

import ast
from typing import List

import pytest
import torch
from sglang_wheel import function, source

from rollout.weights import fp8_blocks
from rollout.weights.fp8_blocks import (BLOCK, E4M3_MAX, Fp8Layout, dequantize_block_fp8, quantize_block_fp8,
                                        scale_name)

FP8 = "layers/quantization/fp8.py"
FP8_UTILS = "layers/quantization/fp8_utils.py"
QUANT_UTILS = "layers/quantization/utils.py"


def _text(path: str, qualname: str) -> str:
    return ast.unparse(function(path, qualname))


def _compiled(path: str, qualname: str, **namespace):
    """SGLang's function `qualname`, compiled alone from its source text."""
    node = function(path, qualname)
    module = ast.Module(body=[node], type_ignores=[])
    scope = {"torch": torch, "List": List, **namespace}
    exec(compile(module, f"sglang/srt/{path}", "exec"), scope)
    return scope[node.name]


def test_linear_weight_is_float8_and_its_scale_inv_float32_one_per_block():
    text = _text(FP8, "Fp8LinearMethod.create_fp8_weight_")
    assert "weight_dtype = torch.float8_e4m3fn if is_checkpoint_fp8_serialized else params_dtype" in text
    assert "layer.register_parameter('weight', weight)" in text
    assert "scale_dtype = torch.uint8 if use_mxfp8 else torch.float32" in text
    assert "(output_size_per_partition + block_n - 1) // block_n" in text
    assert "(input_size_per_partition + block_k - 1) // block_k" in text
    assert "layer.register_parameter('weight_scale_inv', scale)" in text
    assert fp8_blocks.SCALE_SUFFIX == "_scale_inv" and scale_name("x.weight") == "x.weight_scale_inv"
    assert fp8_blocks.WIRE_DTYPE == torch.float8_e4m3fn and fp8_blocks.SCALE_DTYPE == torch.float32


def test_moe_experts_are_float8_with_w13_w2_scale_inv_and_the_expert_mapping_routes_our_names():
    text = _text(FP8, "Fp8MoEMethod.create_fp8_moe_weight_")
    assert "params_dtype = torch.uint32 if _use_hip_int4 else torch.float8_e4m3fn" in text
    for name in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
        assert f"layer.register_parameter('{name}', " in text
    mapping = _text("layers/moe/fused_moe_triton/layer.py", "FusedMoE.make_expert_params_mapping")
    assert "'experts.w13_' if weight_name in [ckpt_gate_proj_name, ckpt_up_proj_name] else 'experts.w2_'" in mapping
    assert "f'experts.{expert_id}.{weight_name}.'" in mapping
    # the loaders do name.replace(weight_name, param_name): our expert scale lands on the registered scale
    ours = scale_name("model.layers.3.mlp.experts.5.gate_proj.weight")
    assert ours.replace("experts.5.gate_proj.", "experts.w13_") == "model.layers.3.mlp.experts.w13_weight_scale_inv"
    ours = scale_name("model.layers.3.mlp.experts.5.down_proj.weight")
    assert ours.replace("experts.5.down_proj.", "experts.w2_") == "model.layers.3.mlp.experts.w2_weight_scale_inv"


def test_the_scale_convention_is_sglangs_dequantization():
    """SGLang's block_quant_dequant (w = q.float() * scale per block) applied to our blocks gives what
    ours gives, shapes not divisible by 128 included; our scale is the block's amax / 448."""
    assert "(x_q_block.to(torch.float32) * x_scale_repeat).to(dtype)" in _text(FP8_UTILS, "block_quant_dequant")
    theirs = _compiled(FP8_UTILS, "block_quant_dequant")
    g = torch.Generator().manual_seed(3)
    for shape in ((256, 384), (130, 260), (7, 300)):
        w = torch.randn(shape, generator=g) * 0.02
        q, scale = quantize_block_fp8(w)
        ref = theirs(q, scale, list(BLOCK), torch.bfloat16)
        assert torch.equal(ref, dequantize_block_fp8(q, scale, torch.bfloat16))
        assert scale[0, 0].item() == pytest.approx(w[:128, :128].abs().max().item() / E4M3_MAX, rel=1e-7)
    assert torch.finfo(torch.float8_e4m3fn).max == E4M3_MAX


def test_checkpoint_config_fields_the_layout_reads():
    text = _text(FP8, "Fp8Config.from_config")
    for field in ("'quant_method'", "'ignored_layers', 'modules_to_not_convert'", "'weight_block_size'"):
        assert field in text
    assert "use_mxfp8 = 'mxfp8' in quant_method" in text
    assert "normalized.append(f'model.{base}')" in text   # both spellings kept, as layout_from_... does


def test_ignored_layers_match_as_sglang_matches_them():
    theirs = _compiled(QUANT_UTILS, "_module_path_match")
    cases = [("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj"), ("layers.1.mlp", "model.layers.1.mlp.down_proj"),
             ("layers.1.mlp", "model.layers.10.mlp.down_proj"), ("mlp.gate", "model.layers.2.mlp.gate_up_proj"),
             ("lm_head", "lm_head"), ("model.layers.2", "model.layers.2.self_attn.o_proj")]
    for ignored, prefix in cases:
        assert fp8_blocks._module_path_match(ignored, prefix) == theirs(ignored, prefix), (ignored, prefix)
    skipped = _text(QUANT_UTILS, "is_layer_skipped")
    assert "elif 'experts' in prefix:" in skipped and "(prefix in layer_name for layer_name in ignored_layers" in skipped


def test_what_stays_unquantized():
    """Fp8Config gives an FP8 method to linear and fused-MoE layers only (embeddings and the LM head get
    none, so VocabParallelEmbedding stays unquantized); the GLM-4.5 and DeepSeek routers are plain
    parameters."""
    text = _text(FP8, "Fp8Config.get_quant_method")
    assert "isinstance(layer, LinearBase)" in text and "isinstance(layer, FusedMoE)" in text
    assert "Embedding" not in text and "LMHead" not in text
    embedding = source("layers/vocab_parallel_embedding.py")
    assert "if quant_method is None:\n            quant_method = UnquantizedEmbeddingMethod()" in embedding
    glm_gate = _text("models/glm4_moe.py", "Glm4MoeGate.__init__")
    assert "nn.Parameter(torch.empty((config.n_routed_experts, config.hidden_size), dtype=torch.float32))" in glm_gate
    assert "quant" not in glm_gate
    ds_gate = _text("models/deepseek_v2.py", "MoEGate.__init__")
    assert "self.weight = nn.Parameter(" in ds_gate
    layout = Fp8Layout()
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert not layout.holds_fp8(name)


def test_updates_receive_float8_by_dtype_name_and_hopper_does_not_requantize_them():
    recv = _text("model_executor/model_runner_components/weight_updater.py",
                 "WeightUpdater.receive_weights_from_distributed")
    assert "getattr(torch, dtype)" in recv
    bucket = _text("weight_sync/tensor_bucket.py", "FlattenedTensorBucket.empty")
    assert "getattr(torch, dtype)" in bucket and "offset % dtype.itemsize" in bucket
    assert isinstance(getattr(torch, str(torch.float8_e4m3fn).removeprefix("torch.")), torch.dtype)
    # end_weight_update re-runs process_weights_after_loading; its block-FP8 branch requantizes to UE8M0
    # only where DeepGEMM's UE8M0 scales are on (SM100 / SM120), so Hopper serves the sent blocks as they are
    configurer = source("layers/deep_gemm_wrapper/configurer.py")
    assert "DEEPGEMM_SCALE_UE8M0 = ENABLE_JIT_DEEPGEMM and (\n    get_platform().is_sm100 or get_device_sm() in (120, 121)\n)" \
        in configurer
    requant = _text("model_loader/utils.py", "should_deepgemm_weight_requant_ue8m0")
    assert "deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0" in requant
    end = _text("model_executor/model_runner_components/weight_updater.py", "WeightUpdater.end_weight_update")
    assert "DefaultModelLoader.postprocess_weights" in end
    # and nothing restores Fp8LinearMethod's weights before a load (base class no-op)
    fp8 = source(FP8)
    assert "def restore_weights_before_loading" not in fp8


def test_deepseek_loader_rederives_mla_from_kv_b_proj_weight_and_scale_per_load():
    text = _text("models/deepseek_common/deepseek_weight_loader.py", "DeepseekV2WeightLoaderMixin.post_load_weights")
    assert "if 'kv_b_proj' in name:" in text and "self_attn.kv_b_proj.weight_scale_inv" in text
