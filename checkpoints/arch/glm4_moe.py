"""GLM-4.5 / GLM-4.6 MoE (Glm4MoeForCausalLM): first_k_dense_replace dense layers, then MoE layers
with one shared expert, a sigmoid router with e_score_correction_bias (noaux_tc) and routed_scaling_factor,
q/k/v biases (attention_bias), optional per-head q/k norm (use_qk_norm) and partial RoPE (0.5).

Not mapped: the multi-token-prediction layers that GLM checkpoints store after the last decoder layer
(`model.layers.{num_hidden_layers + i}`, num_nextn_predict_layers of them); convert.py reports them as
unmapped instead of silently dropping them.
"""
from __future__ import annotations

from .family import Family
from .megatron_parts import first_k_dense, gqa_kwargs, partial_rope, sigmoid_router_kwargs
from .spec import ArchSpec, config_get

NAME = "glm4_moe"


def qk_norm(cfg) -> bool:
    return bool(cfg.get("use_qk_norm", False))


def spec_from_hf_config(cfg: dict) -> ArchSpec:
    a = NAME
    layers = config_get(cfg, a, "num_hidden_layers")
    num_heads = config_get(cfg, a, "num_attention_heads")
    hidden = config_get(cfg, a, "hidden_size")
    first_dense = cfg.get("first_k_dense_replace", 1)
    shared = cfg.get("n_shared_experts", 1) or 0
    if shared > 1:
        raise ValueError(f"{a}: n_shared_experts={shared}; only 0 or 1 shared expert is mapped")
    return ArchSpec(
        arch=a, num_layers=layers, hidden_size=hidden, num_heads=num_heads,
        num_kv_heads=config_get(cfg, a, "num_key_value_heads"),
        head_dim=config_get(cfg, a, "head_dim", default=hidden // num_heads),
        vocab_size=config_get(cfg, a, "vocab_size"),
        num_experts=config_get(cfg, a, "n_routed_experts", "num_local_experts"),
        moe_layers=frozenset(range(first_dense, layers)), shared_experts=shared == 1,
        qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=qk_norm(cfg),
        expert_bias=True, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def megatron_kwargs(hf) -> dict:
    return dict(**sigmoid_router_kwargs(hf), **gqa_kwargs(hf), qk_layernorm=qk_norm(hf),
                add_qkv_bias=bool(hf.get("attention_bias", True)))


_COMMON = dict(
    architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_attention_heads=96, num_key_value_heads=8,
    head_dim=128, attention_bias=True, vocab_size=151552, num_experts_per_tok=8, n_shared_experts=1,
    norm_topk_prob=True, max_position_embeddings=131072, rope_theta=1e6, partial_rotary_factor=0.5,
    tie_word_embeddings=False, scoring_func="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1,
    num_nextn_predict_layers=1,
)
SHAPES = {
    "glm4.5-355b-a32b": dict(
        _COMMON, hidden_size=5120, num_hidden_layers=92, first_k_dense_replace=3, use_qk_norm=True,
        intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160, routed_scaling_factor=2.5,
    ),
    "glm4.5-air": dict(
        _COMMON, hidden_size=4096, num_hidden_layers=46, first_k_dense_replace=1, use_qk_norm=False,
        intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128, routed_scaling_factor=1.0,
    ),
}

# The tiny Qwen3-MoE's sizes (hidden 64, 4 layers, 8 experts top-2) with GLM's parts: first layer dense
# (the layer-axis case routing replay must get right), one shared expert, q/k/v biases, q/k norms.
PRESETS = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, max_position_embeddings=1024, tie_word_embeddings=False,
        num_key_value_heads=2, head_dim=32, attention_bias=True, use_qk_norm=True,
    ),
}

FAMILY = Family(
    name=NAME, model_types=("glm4_moe",), hf_config_class="Glm4MoeConfig", hf_model_class="Glm4MoeForCausalLM",
    spec=spec_from_hf_config, megatron=megatron_kwargs, rotary=partial_rope, dense_first_layers=first_k_dense,
    qk_norm=qk_norm, shapes=SHAPES, presets=PRESETS,
)
