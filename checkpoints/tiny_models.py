"""Tiny random GLM-4.5 and GLM-5-class HF checkpoints (the shapes of checkpoints/init_model.py's tiny
Qwen3-MoE: vocab 105, hidden 64, 4 layers, 8 experts top-2), used to test the conversion of those
families against transformers and Megatron. No tokenizer: they are weight fixtures, not demo models.
Router biases are randomised so that a dropped or misplaced e_score_correction_bias shows in logits.
"""
from __future__ import annotations

from pathlib import Path

COMMON = dict(vocab_size=105, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=None, eos_token_id=2)


def make_tiny_hf(out_dir: str | Path, arch: str, seed: int = 0) -> Path:
    """Write config.json + model.safetensors of a tiny random `arch` ("glm4_moe" | "glm5") model."""
    out = Path(out_dir)
    build_tiny_model(arch, seed).save_pretrained(out)
    return out


def build_tiny_model(arch: str, seed: int = 0, **overrides):
    """A tiny random `arch` ("glm4_moe" | "glm5") transformers model; `overrides` change COMMON's
    fields (checkpoints/init_model.py passes its tokenizer's vocabulary and special ids)."""
    import torch
    import transformers

    fields = {**COMMON, **overrides}
    if arch == "glm4_moe":
        config = transformers.Glm4MoeConfig(**fields, num_key_value_heads=2, head_dim=32, attention_bias=True,
                                            use_qk_norm=True)
        model_cls = transformers.Glm4MoeForCausalLM
    elif arch == "glm5":
        # index_topk above any test length: the DSA indexer keeps every key, so attention is dense MLA
        config = transformers.GlmMoeDsaConfig(**fields, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                                              qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, head_dim=16,
                                              index_topk=2048, index_head_dim=32, index_n_heads=2)
        model_cls = transformers.GlmMoeDsaForCausalLM
    else:
        raise ValueError(f"no tiny {arch!r} model; fix: use glm4_moe or glm5 (qwen3_moe: checkpoints.init_model)")
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.copy_(torch.randn_like(buf) * 0.1)
    return model
