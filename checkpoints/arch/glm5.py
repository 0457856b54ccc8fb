"""GLM-5-class (GlmMoeDsaForCausalLM, model_type glm_moe_dsa) and DeepSeek-V3 (deepseek_v3): multi-latent
attention (q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj),
dense first layers, one shared expert, sigmoid router with e_score_correction_bias.

Megatron side: MLATransformerConfig, which needs the Transformer Engine layer spec (GPU): the local
spec's attention cannot run MLA in Megatron-Core 0.16.1. The DSA sparse indexer is not modelled:
attention is dense MLA.

Not mapped, because the trainer's Megatron model does not hold them: the DSA indexer
(`self_attn.indexer.*`) and the multi-token-prediction layers. They are reported as unmapped; engines
keep their own copies, which the trainer never changes.

RoPE: HF applies the rotary part of q and k as interleaved pairs; Megatron's MLA de-interleaves inside
apply_rotary_pos_emb (multi_latent_attention=True), so the weights are copied as they are.
"""
from __future__ import annotations

from .family import Family
from .megatron_parts import first_k_dense, rope_theta, sigmoid_router_kwargs
from .spec import ArchSpec, config_get

NAME = "glm5"


def qk_norm(cfg) -> bool:
    return False  # MLA normalises the q and kv latents, not per-head q/k


def spec_from_hf_config(cfg: dict, arch: str = NAME) -> ArchSpec:
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
        moe_layers=moe, shared_experts=shared == 1, qk_norm=qk_norm(cfg), expert_bias=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), mla=True,
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
    )


def megatron_kwargs(hf) -> dict:
    return dict(**sigmoid_router_kwargs(hf),
                q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=int(hf["kv_lora_rank"]),
                qk_head_dim=int(hf["qk_nope_head_dim"]), qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]),
                v_head_dim=int(hf["v_head_dim"]), qk_layernorm=True, rope_type="rope",
                rotary_base=rope_theta(hf), num_query_groups=int(hf["num_attention_heads"]))


def rotary_kwargs(hf) -> dict:
    """MLA carries its RoPE settings in the TransformerConfig; GPTModel gets the base only."""
    return dict(position_embedding_type="rope", rotary_base=int(rope_theta(hf)))


_DSA_SHAPE = dict(scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=1, attention_bias=False,
                  norm_topk_prob=True, n_shared_experts=1, num_experts_per_tok=8, routed_scaling_factor=2.5,
                  tie_word_embeddings=False, first_k_dense_replace=3, moe_intermediate_size=2048, n_routed_experts=256)
SHAPES = {
    # GLM-5 / GLM-5.1 (744B-A40B; 753.9B with the MTP layer): MLA + DSA indexer on every layer.
    "glm5-744b-a40b": dict(
        _DSA_SHAPE, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", hidden_size=6144,
        num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, vocab_size=154880, intermediate_size=12288,
        n_group=1, topk_group=1, index_n_heads=32, index_head_dim=128, index_topk=2048,
        max_position_embeddings=202752, rope_theta=1e6,
    ),
    "deepseek-v3": dict(
        _DSA_SHAPE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, intermediate_size=18432,
        n_group=8, topk_group=4, max_position_embeddings=163840, rope_theta=1e4,
    ),
}

# The GLM-4.5 tiny sizes with MLA; index_topk above any test length, so the DSA indexer keeps every
# key and attention is dense MLA, as in the trainer.
PRESETS = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, max_position_embeddings=1024, tie_word_embeddings=False,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, head_dim=16, index_topk=2048, index_head_dim=32, index_n_heads=2,
    ),
}

FAMILY = Family(
    name=NAME, model_types=("glm_moe_dsa", "deepseek_v3"), hf_config_class="GlmMoeDsaConfig",
    hf_model_class="GlmMoeDsaForCausalLM", spec=spec_from_hf_config, megatron=megatron_kwargs,
    rotary=rotary_kwargs, dense_first_layers=first_k_dense, qk_norm=qk_norm, shapes=SHAPES, presets=PRESETS,
    mla=True,
)
