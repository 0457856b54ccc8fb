"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B; Qwen3MoeForCausalLM): every layer MoE unless listed in
mlp_only_layers or skipped by decoder_sparse_step; per-head q/k RMSNorm; no biases; softmax top-k router
without bias (top-k renormalised when norm_topk_prob); full RoPE. The trainer runs all-MoE configs only."""
from __future__ import annotations

from .family import Family, SpecError
from .megatron_parts import gqa_kwargs, partial_rope
from .spec import ArchSpec, config_get

NAME = "qwen3_moe"


def qk_norm(cfg) -> bool:
    return True  # Qwen3 always has per-head q/k norms


def spec_from_hf_config(cfg: dict) -> ArchSpec:
    a = NAME
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
        moe_layers=moe, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=qk_norm(cfg),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def megatron_kwargs(hf) -> dict:
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise SpecError("qwen3_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                        "is not supported; every layer must be MoE")
    return dict(**gqa_kwargs(hf), qk_layernorm=True, add_qkv_bias=bool(hf.get("attention_bias", False)),
                moe_router_score_function="softmax", moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", True)))


SHAPES = {
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, attention_bias=False, use_qk_norm=True,
        vocab_size=151936, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, n_shared_experts=0, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False, scoring_func="softmax",
    ),
}

# head_dim >= 32 keeps every engine's attention kernels happy.
_ROPE = {"rope_type": "default", "rope_theta": 1e6}
PRESETS = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        decoder_sparse_step=1, router_aux_loss_coef=0.0, rope_parameters=_ROPE,
    ),
    "small": dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        decoder_sparse_step=1, router_aux_loss_coef=0.0, rope_parameters=_ROPE,
    ),
}

FAMILY = Family(
    name=NAME, model_types=("qwen3_moe",), hf_config_class="Qwen3MoeConfig", hf_model_class="Qwen3MoeForCausalLM",
    spec=spec_from_hf_config, megatron=megatron_kwargs, rotary=partial_rope, dense_first_layers=lambda hf: 0,
    qk_norm=qk_norm, shapes=SHAPES, presets=PRESETS,
)
