"""Create a randomly initialised HF model and a locally built tokenizer: no hub, no download.

`sao init-model --arch qwen3_moe --preset tiny OUT_DIR` calls `init_model`. The tokenizer is
character-level (every printable ASCII character is one token), which suits the arithmetic and
string tasks the tiny models learn and keeps the vocabulary ~100 tokens.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

from .arch import FAMILIES

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# (arch, preset) -> transformers config kwargs, from each family's presets in checkpoints/arch.
PRESETS: dict[tuple[str, str], dict] = {(f.name, p): kw for f in FAMILIES for p, kw in f.presets.items()}


def build_tokenizer():
    """A character-level fast tokenizer with the chat special tokens, built in memory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable[:95]) + ["\n", "\t"]  # digits, letters, punctuation, space, newline, tab
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    vocab["<unk>"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def init_model(out_dir: str | Path, arch: str = "qwen3_moe", preset: str = "tiny", seed: int = 0,
               dtype: str = "fp32") -> Path:
    """Write config.json, model.safetensors and the tokenizer files into `out_dir`."""
    import torch

    from .tiny_models import build_tiny_model

    if (arch, preset) not in PRESETS:
        known = ", ".join(f"{a}/{p}" for a, p in PRESETS)
        raise ValueError(f"no preset {arch}/{preset}; known: {known}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = dict(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    model = build_tiny_model(arch, seed, preset, **ids)
    model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "sao_init.json").write_text(json.dumps({"arch": arch, "preset": preset, "seed": seed}))
    return out
