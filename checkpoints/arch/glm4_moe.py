"""GLM-4.5 / GLM-4.6 MoE (Glm4MoeForCausalLM): first_k_dense_replace dense layers, then MoE layers
with one shared expert, a sigmoid router with e_score_correction_bias, q/k/v biases (attention_bias)
and optional per-head q/k norm (use_qk_norm).

Not mapped: the multi-token-prediction layers that GLM checkpoints store after the last decoder layer
(`model.layers.{num_hidden_layers + i}`, num_nextn_predict_layers of them); convert.py reports them as
unmapped instead of silently dropping them.
"""
from __future__ import annotations

from .spec import ArchSpec, config_get


def spec_from_hf_config(cfg: dict) -> ArchSpec:
    a = "glm4_moe"
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
        qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=bool(cfg.get("use_qk_norm", False)),
        expert_bias=True, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
