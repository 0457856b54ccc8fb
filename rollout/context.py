"""Fitting a generate request into the engine's context length, so a run never sends one SGLang refuses.

SGLang 0.5.23 answers 400 (tokenizer_manager.py ``_validate_one_request``, unless the server runs
with --allow-auto-truncate) when a prompt is at least the context length, or when prompt + an
explicit max_new_tokens passes it; the reference server refuses the same way. A 400 is the same on
every engine, so retrying cannot help: every caller (the rollout driver and its agent turns, the
evals, the bench) caps max_new_tokens here first. A prompt that alone does not fit fails that one
sample with a one-line reason (PromptTooLong); the context a run uses is ``model.max_seq_len``
(never above the model's max_position_embeddings, which is what engines started here serve).
"""
from __future__ import annotations

from typing import Optional


class PromptTooLong(ValueError):
    """A prompt that leaves no room for one generated token: the message is the sample's one-line reason."""


def fit_max_new_tokens(prompt_len: int, input_len: int, max_new_tokens: int, context_length: Optional[int],
                       field: str = "model.max_seq_len") -> int:
    """max_new_tokens capped so that input_len + it <= context_length; 0 when the context is full
    (the sample ends as if by length). PromptTooLong when the prompt itself (prompt_len, before any
    response tokens) is at least the context. ``field`` names where the context length comes from."""
    if context_length is None:
        return max_new_tokens
    if prompt_len >= context_length:
        raise PromptTooLong(f"prompt of {prompt_len} tokens does not fit the context of {context_length} "
                            f"tokens ({field}); shorten the prompt or raise {field}")
    return max(0, min(max_new_tokens, context_length - input_len))
