"""HF config.json -> Megatron TransformerConfig for qwen3_moe, glm4_moe and the GLM-5-class MLA preset."""
from __future__ import annotations

import json

import pytest
import torch

from parallel import specs
from sao_megatron.core.dims import ParallelDims
from parallel.fp8 import FP8Unavailable, fp8_config_kwargs

GLM45 = dict(model_type="glm4_moe", num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, intermediate_size=128, moe_intermediate_size=32,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
             routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True, use_qk_norm=True,
             attention_bias=True, partial_rotary_factor=0.5, rope_theta=1e6, vocab_size=300, rms_norm_eps=1e-5)
GLM5 = dict(model_type="glm_moe_dsa", num_hidden_layers=78, hidden_size=6144, num_attention_heads=64,
            num_key_value_heads=64, intermediate_size=12288, moe_intermediate_size=2048, n_routed_experts=256,
            n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, routed_scaling_factor=2.5,
            n_group=1, topk_group=1, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
            qk_rope_head_dim=64, v_head_dim=256, rope_theta=1e6, vocab_size=154880, rms_norm_eps=1e-5)


def test_qwen3_moe_config_from_tiny_model(tiny_model_dir):
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    cfg = specs.transformer_config(hf, ParallelDims())
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 64, 4, 2, 32)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (8, 2, 64)
    assert cfg.qk_layernorm and cfg.moe_router_score_function == "softmax" and not cfg.moe_router_pre_softmax
    assert cfg.moe_shared_expert_intermediate_size is None and not cfg.add_bias_linear
    assert specs.rotary_kwargs(hf) == dict(position_embedding_type="rope", rotary_base=1000000, rotary_percent=1.0)


def test_glm45_shared_expert_sigmoid_router_dense_first_layers():
    cfg = specs.transformer_config(GLM45, ParallelDims())
    assert cfg.moe_layer_freq == [0, 1, 1, 1]
    assert cfg.moe_shared_expert_intermediate_size == 32
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert cfg.moe_router_topk_scaling_factor == 2.5 and cfg.add_qkv_bias and cfg.qk_layernorm
    assert specs.rotary_kwargs(GLM45)["rotary_percent"] == 0.5
    assert specs.arch_shape(GLM45).num_moe_layers == 3


def test_glm5_class_preset_uses_mla():
    cfg = specs.transformer_config(GLM5, ParallelDims())
    assert type(cfg).__name__ == "MLATransformerConfig" and cfg.multi_latent_attention
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (2048, 512, 192, 64, 256)
    assert cfg.num_moe_experts == 256 and cfg.moe_layer_freq[:4] == [0, 0, 0, 1]


def test_unknown_model_type_is_one_line_error():
    with pytest.raises(specs.SpecError, match="model_type 'llama' is not supported"):
        specs.transformer_config({"model_type": "llama"}, ParallelDims())


def test_padded_vocab_equal_shards():
    assert specs.padded_vocab_size(105, 1) == 128 and specs.padded_vocab_size(105, 2) == 128
    assert specs.padded_vocab_size(151936, 8) == 151936 and specs.padded_vocab_size(129, 3) == 384


def test_local_spec_on_cpu():
    assert specs.use_transformer_engine("auto") is torch.cuda.is_available() and not specs.use_transformer_engine("local")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_fp8_on_cpu_is_one_line_error():
    with pytest.raises(FP8Unavailable, match="no CUDA: set model.fp8 = 'none'"):
        fp8_config_kwargs("blockwise")
    assert fp8_config_kwargs("none") == {}
    assert fp8_config_kwargs("mxfp8", check_device=False) == {"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param": False}
    with pytest.raises(ValueError, match="not a recipe"):
        fp8_config_kwargs("fp4")


def test_glm5_class_is_dsa_with_an_indexer_per_layer():
    from parallel.model_shapes import get_shape

    cfg = specs.transformer_config(get_shape("glm5-744b-a40b"), ParallelDims())
    assert cfg.experimental_attention_variant == "dsa" and cfg.dsa_indexer_topk == 2048
    assert (cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim) == (32, 128)
    assert cfg.sao_indexer_types == ["full"] * 78


def test_dsa_with_context_parallel_is_one_line_error():
    with pytest.raises(specs.SpecError, match=r"parallel.cp = 2 with a DSA model .* fix: set parallel.cp = 1"):
        specs.transformer_config(dict(GLM5, index_topk=2048, index_n_heads=32, index_head_dim=128), ParallelDims(cp=2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_context_parallel_on_local_spec_is_one_line_error(tiny_model_dir):
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    cfg = specs.transformer_config(hf, ParallelDims(cp=2))
    with pytest.raises(specs.SpecError, match=r"parallel.cp=2 needs the Transformer Engine layer spec"):
        specs.layer_spec(cfg, "auto")


def test_non_interleaved_rope_is_one_line_error():
    from parallel.model_shapes import get_shape

    for key in ("rope_interleave", "indexer_rope_interleave"):
        with pytest.raises(specs.SpecError, match=f"config.json {key} = false") as err:
            specs.transformer_config(dict(get_shape("glm5-744b-a40b"), **{key: False}), ParallelDims())
        assert "\n" not in str(err.value)
