"""GLM-5-class (GlmMoeDsaForCausalLM, model_type glm_moe_dsa) and DeepSeek-V3 (deepseek_v3): multi-latent
attention (q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj),
dense first layers, one shared expert, sigmoid router with e_score_correction_bias.

Not mapped, because the trainer's Megatron model does not hold them (parallel/specs.py: attention is
dense MLA): the DSA indexer (`self_attn.indexer.*`) and the multi-token-prediction layers. They are
reported as unmapped; engines keep their own copies, which the trainer never changes.

RoPE: HF applies the rotary part of q and k as interleaved pairs; Megatron's MLA de-interleaves inside
apply_rotary_pos_emb (multi_latent_attention=True), so the weights are copied as they are.
"""
from __future__ import annotations

from .spec import ArchSpec, config_get


def spec_from_hf_config(cfg: dict, arch: str = "glm5") -> ArchSpec:
    layers = config_get(cfg, arch, "num_hidden_layers")
    num_heads = config_get(cfg, arch, "num_attention_heads")
    kinds = cfg.get("mlp_layer_types")
    if kinds:
        moe = frozenset(i for i, kind in enumerate(kinds) if kind == "sparse")
    else:
        moe = frozenset(range(cfg.get("first_k_dense_replace", 0), layers))
    shared = cfg.get("n_shared_experts", 1) or 0
    if shared > 1:
        raise ValueError(f"{arch}: n_shared_experts={shared}; only 0 or 1 shared expert is mapped")
    if cfg.get("attention_bias"):
        raise ValueError(f"{arch}: attention_bias=true is not mapped for multi-latent attention")
    return ArchSpec(
        arch=arch, num_layers=layers, hidden_size=config_get(cfg, arch, "hidden_size"), num_heads=num_heads,
        num_kv_heads=num_heads, head_dim=config_get(cfg, arch, "qk_nope_head_dim") + config_get(cfg, arch, "qk_rope_head_dim"),
        vocab_size=config_get(cfg, arch, "vocab_size"),
        num_experts=config_get(cfg, arch, "n_routed_experts", "num_local_experts"),
        moe_layers=moe, shared_experts=shared == 1, qk_norm=False, expert_bias=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), mla=True,
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
    )
