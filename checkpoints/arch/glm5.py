"""GLM-5-class (GlmMoeDsaForCausalLM, model_type glm_moe_dsa): multi-latent attention (q_a_proj ->
q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj) with DeepSeek Sparse
Attention (DSA: a lightning indexer picks each query's `index_topk` keys), dense first layers, one shared
expert, sigmoid router with e_score_correction_bias. DeepSeek-V3 (deepseek_v3.py) is this family without
the indexer and reuses these functions.

Megatron side: MLATransformerConfig with our own core attention (parallel/mla_attention.py: dense MLA,
or sparse MLA with the indexer), on the local spec (CPU) and the Transformer Engine spec (GPU) alike;
`experimental_attention_variant = "dsa"` makes Megatron's MLASelfAttention hand the indexer its inputs
(the layer's hidden states and the normalised q latent). Layers whose `indexer_types` entry is "shared"
have no indexer and reuse the previous full layer's selection, as transformers and SGLang do.

Not mapped: the multi-token-prediction (next-n) layers, which the trainer does not hold; engines keep
their own copies, and the recipes turn speculative decoding off (docs/cluster.md).

RoPE: HF applies the rotary part of q and k as interleaved pairs; Megatron's MLA de-interleaves inside
apply_rotary_pos_emb (multi_latent_attention=True), so the weights are copied as they are. The GLM-5
indexer applies interleaved RoPE to the first qk_rope_head_dim channels of its heads
(modeling_glm_moe_dsa.py GlmMoeDsaIndexer.forward); parallel/mla_attention.py does the same.
"""
from __future__ import annotations

from .family import Family, SpecError
from .megatron_parts import first_k_dense, rope_theta, sigmoid_router_kwargs
from .spec import ArchSpec, config_get

NAME = "glm5"


def qk_norm(cfg) -> bool:
    return False  # MLA normalises the q and kv latents, not per-head q/k


def use_engine_latent_norm_eps(model) -> None:
    """Give an HF MLA model's latent norms (q_a_layernorm, kv_a_layernorm) the config's rms_norm_eps, in place.

    SGLang 0.5.23 builds them with eps=config.rms_norm_eps (models/deepseek_v2.py:2077, 2163), as Megatron
    does (layernorm_epsilon); transformers 5.25 hard-codes 1e-6 (modeling_glm_moe_dsa.py:309, 317;
    modeling_deepseek_v3.py:364, 376). GLM-5's rms_norm_eps is 1e-5, so an unpatched HF model is neither
    the engine nor the trainer."""
    eps = float(getattr(model.config, "rms_norm_eps", 1e-6))
    for name, module in model.named_modules():
        if name.endswith(("q_a_layernorm", "kv_a_layernorm")) and hasattr(module, "variance_epsilon"):
            module.variance_epsilon = eps


def indexer_types(cfg: dict) -> list[str]:
    """Per layer "full" (own indexer), "shared" (reuses the previous full layer's top-k) or "none" (no DSA),
    as transformers' GlmMoeDsaConfig derives them (explicit list, else index_topk_pattern, else
    index_topk_freq / index_skip_topk_offset)."""
    layers = int(cfg["num_hidden_layers"])
    if not cfg.get("index_topk"):
        return ["none"] * layers
    kinds = cfg.get("indexer_types")
    if kinds is None:
        pattern = cfg.get("index_topk_pattern")
        if pattern is not None:
            kinds = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq, offset = max(int(cfg.get("index_topk_freq", 1)), 1), int(cfg.get("index_skip_topk_offset", 2))
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    kinds = list(kinds)
    if len(kinds) != layers or set(kinds) - {"full", "shared"} or (kinds and kinds[0] != "full"):
        raise ValueError(f"config.json indexer_types {kinds!r}: need {layers} entries of 'full'/'shared', "
                         "the first 'full' (a shared layer reuses the previous full layer's selection)")
    return kinds


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
        indexer_layers=frozenset(i for i, kind in enumerate(indexer_types(cfg)) if kind == "full"),
    )


def mla_rope_kwargs(hf) -> dict:
    """MLATransformerConfig's RoPE fields from the HF rope parameters: plain RoPE, or YaRN with its
    scaling factor and mscales (DeepSeek-V3's released config)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return dict(rope_type="rope", rotary_base=rope_theta(hf))
    if kind != "yarn":
        raise SpecError(f"config.json rope_type {kind!r}: multi-latent attention maps 'default' or 'yarn' RoPE only")
    return dict(rope_type="yarn", rotary_base=rope_theta(hf), rotary_scaling_factor=float(params["factor"]),
                original_max_position_embeddings=int(params.get("original_max_position_embeddings", 4096)),
                beta_fast=float(params.get("beta_fast", 32)), beta_slow=float(params.get("beta_slow", 1)),
                mscale=float(params.get("mscale", 1.0)), mscale_all_dim=float(params.get("mscale_all_dim", 0.0)))


def mla_kwargs(hf) -> dict:
    """MLA attention and the DeepSeek router, shared by GLM-5 and DeepSeek-V3."""
    if hf.get("rope_interleave") is False:
        raise SpecError("config.json rope_interleave = false: Megatron's MLA always de-interleaves the rotary "
                        "channels, so only interleaved checkpoints (every released DeepSeek-V3 / GLM-5) map")
    return dict(**sigmoid_router_kwargs(hf), **mla_rope_kwargs(hf),
                q_lora_rank=hf.get("q_lora_rank") or None, kv_lora_rank=int(hf["kv_lora_rank"]),
                qk_head_dim=int(hf["qk_nope_head_dim"]), qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]),
                v_head_dim=int(hf["v_head_dim"]), qk_layernorm=True,
                num_query_groups=int(hf["num_attention_heads"]))


def megatron_kwargs(hf) -> dict:
    kwargs = mla_kwargs(hf)
    if hf.get("indexer_rope_interleave") is False:
        raise SpecError("config.json indexer_rope_interleave = false: transformers' GLM-5 indexer, the reference "
                        "server and the trainer rotate interleaved pairs only (modeling_glm_moe_dsa.py:220), so "
                        "the selections would differ from SGLang's; only interleaved GLM-5 checkpoints map")
    if hf.get("index_topk"):
        # Megatron reads these fields only to hand the core attention its indexer inputs and to size
        # nothing else: our core attention (parallel/mla_attention.py) owns the indexer.
        kwargs.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=int(hf["index_n_heads"]),
                      dsa_indexer_head_dim=int(hf["index_head_dim"]), dsa_indexer_topk=int(hf["index_topk"]))
    return kwargs


def rotary_kwargs(hf) -> dict:
    """MLA carries its RoPE settings in the TransformerConfig; GPTModel gets the base only."""
    return dict(position_embedding_type="none")


DEEPSEEK_SHAPE_DEFAULTS = dict(scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=1, attention_bias=False,
                  norm_topk_prob=True, n_shared_experts=1, num_experts_per_tok=8, routed_scaling_factor=2.5,
                  tie_word_embeddings=False, first_k_dense_replace=3, moe_intermediate_size=2048, n_routed_experts=256)
SHAPES = {
    # GLM-5 / GLM-5.1 (744B-A40B; 753.9B with the MTP layer): MLA + DSA indexer on every layer.
    "glm5-744b-a40b": dict(
        DEEPSEEK_SHAPE_DEFAULTS, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", hidden_size=6144,
        num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, vocab_size=154880, intermediate_size=12288,
        n_group=1, topk_group=1, index_n_heads=32, index_head_dim=128, index_topk=2048,
        max_position_embeddings=202752, rope_theta=1e6,
    ),
}

# Tiny sizes: MLA with a query-key head (16 + 8) wider than the value head (16), as DeepSeek-V3's 192 vs
# 128; the DSA indexer keeps 4 keys per query (every test sequence is longer, so every test exercises
# sparsity) and layer 2 reuses layer 1's selection (indexer pattern F F S F, GLM-5's index_topk_freq).
_TINY = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, max_position_embeddings=1024, tie_word_embeddings=False,
    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16,
)
PRESETS = {
    "tiny": dict(_TINY, index_topk=4, index_head_dim=16, index_n_heads=2, indexer_types=["full", "full", "shared", "full"]),
}
DEEPSEEK_V3_PRESETS = {
    # DeepSeek-V3: no indexer, group-limited routing (2 groups of 4 experts, top-1 group), q LoRA off
    # in the second preset so both MLA query paths are built.
    "tiny": dict(_TINY, n_group=2, topk_group=1, rope_interleave=True),
    "tiny-no-q-lora": dict(_TINY, n_group=2, topk_group=1, q_lora_rank=None, rope_interleave=True),
}

FAMILY = Family(
    name=NAME, model_types=("glm_moe_dsa",), hf_config_class="GlmMoeDsaConfig",
    hf_model_class="GlmMoeDsaForCausalLM", spec=spec_from_hf_config, megatron=megatron_kwargs,
    rotary=rotary_kwargs, dense_first_layers=first_k_dense, qk_norm=qk_norm, shapes=SHAPES, presets=PRESETS,
    mla=True,
)
