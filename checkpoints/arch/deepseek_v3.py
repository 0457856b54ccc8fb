"""DeepSeek-V3 (DeepseekV3ForCausalLM, model_type deepseek_v3): GLM-5's family without the DSA indexer.

Multi-latent attention with or without the q LoRA (q_lora_rank null: one q_proj), YaRN RoPE in the
released config, dense first layers, one shared expert, sigmoid router with e_score_correction_bias
and group-limited top-k (n_group / topk_group). Everything is read by glm5.py's functions; only the HF
classes, the shapes and the presets differ.
"""
from __future__ import annotations

from . import glm5
from .family import Family
from .megatron_parts import first_k_dense

NAME = "deepseek_v3"


def spec_from_hf_config(cfg: dict, arch: str = NAME):
    if cfg.get("index_topk"):
        raise ValueError(f"{arch} config.json has index_topk: a DSA model (DeepSeek-V3.2 / GLM-5) is not "
                         "DeepSeek-V3; fix: use model.arch = \"glm5\" for glm_moe_dsa checkpoints")
    return glm5.spec_from_hf_config(cfg, arch)


SHAPES = {
    "deepseek-v3": dict(
        glm5.DEEPSEEK_SHAPE_DEFAULTS, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, intermediate_size=18432,
        n_group=8, topk_group=4, max_position_embeddings=163840, rope_theta=1e4,
    ),
}

FAMILY = Family(
    name=NAME, model_types=("deepseek_v3",), hf_config_class="DeepseekV3Config",
    hf_model_class="DeepseekV3ForCausalLM", spec=spec_from_hf_config, megatron=glm5.mla_kwargs,
    rotary=glm5.rotary_kwargs, dense_first_layers=first_k_dense, qk_norm=glm5.qk_norm, shapes=SHAPES,
    presets=glm5.DEEPSEEK_V3_PRESETS, mla=True,
)
