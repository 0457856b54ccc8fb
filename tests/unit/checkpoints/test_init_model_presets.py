"""`sao init-model` for every family the trainer runs: a model and tokenizer that agree on ids."""
from __future__ import annotations

import json

import pytest

from checkpoints.init_model import PRESETS, init_model


@pytest.mark.parametrize("arch", ["glm4_moe", "glm5"])
def test_tiny_glm_models_come_with_the_char_tokenizer(tmp_path, arch):
    import transformers

    out = init_model(tmp_path / arch, arch=arch, preset="tiny", seed=3)
    cfg = json.loads((out / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert cfg["model_type"] == {"glm4_moe": "glm4_moe", "glm5": "glm_moe_dsa"}[arch]
    assert cfg["vocab_size"] == len(tok)
    assert cfg["eos_token_id"] == tok.eos_token_id and cfg["pad_token_id"] == tok.pad_token_id
    assert cfg["first_k_dense_replace"] == 1   # the layer-axis case routing replay must get right
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = tok("1+2=", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))


def test_unknown_preset_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="glm4_moe/tiny"):
        init_model(tmp_path, arch="glm4_moe", preset="huge")
    assert ("qwen3_moe", "small") in PRESETS
