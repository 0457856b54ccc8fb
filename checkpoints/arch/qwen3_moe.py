"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): every layer MoE unless listed in mlp_only_layers or
skipped by decoder_sparse_step; per-head q/k RMSNorm; no biases; softmax top-k router without bias."""
from __future__ import annotations

from .spec import ArchSpec, config_get


def spec_from_hf_config(cfg: dict) -> ArchSpec:
    a = "qwen3_moe"
    layers = config_get(cfg, a, "num_hidden_layers")
    num_heads = config_get(cfg, a, "num_attention_heads")
    hidden = config_get(cfg, a, "hidden_size")
    step = cfg.get("decoder_sparse_step") or 1
    dense_only = set(cfg.get("mlp_only_layers") or [])
    # HF rule (Qwen3MoeDecoderLayer): MoE iff not in mlp_only_layers and (L + 1) % step == 0.
    moe = frozenset(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    return ArchSpec(
        arch=a, num_layers=layers, hidden_size=hidden, num_heads=num_heads,
        num_kv_heads=config_get(cfg, a, "num_key_value_heads"),
        head_dim=config_get(cfg, a, "head_dim", default=hidden // num_heads),
        vocab_size=config_get(cfg, a, "vocab_size"),
        # transformers 5 writes num_local_experts; 4.x checkpoints on the hub say num_experts.
        num_experts=config_get(cfg, a, "num_local_experts", "num_experts"),
        moe_layers=moe, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
