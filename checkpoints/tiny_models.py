"""Tiny random HF models of any registered family, built from the family's preset (checkpoints/arch).

`build_tiny_model` is what `sao init-model` calls (with its tokenizer's vocabulary and special ids);
`make_tiny_hf` writes a weight fixture without a tokenizer (FIXTURE: the char tokenizer's vocabulary
size 105 and fixed ids), used to test the conversion of a family against transformers and Megatron.
Router biases are randomised so that a dropped or misplaced e_score_correction_bias shows in logits.
"""
from __future__ import annotations

import copy
from pathlib import Path

from .arch import family

FIXTURE = dict(vocab_size=105, pad_token_id=0, bos_token_id=None, eos_token_id=2, max_position_embeddings=256)


def make_tiny_hf(out_dir: str | Path, arch: str, seed: int = 0, preset: str = "tiny") -> Path:
    """Write config.json + model.safetensors of a tiny random `arch` model (no tokenizer)."""
    out = Path(out_dir)
    build_tiny_model(arch, seed, preset, **FIXTURE).save_pretrained(out)
    return out


def build_tiny_model(arch: str, seed: int = 0, preset: str = "tiny", **overrides):
    """A random `arch` transformers model of the family's `preset`; `overrides` (token ids, vocabulary,
    context length) change the preset's config fields."""
    import torch
    import transformers

    fam = family(arch)
    if preset not in fam.presets:
        raise ValueError(f"no preset {arch}/{preset}; fix: use one of {sorted(fam.presets)}")
    config = getattr(transformers, fam.hf_config_class)(**{**copy.deepcopy(fam.presets[preset]), **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, fam.hf_model_class)(config)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.copy_(torch.randn_like(buf) * 0.1)
    return model
