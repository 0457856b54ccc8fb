"""`sao convert`: Convert checkpoints between HF and Megatron."""
from __future__ import annotations

from ._pending import register_pending


def register(sub) -> None:
    register_pending(sub, "convert", "Convert checkpoints between HF and Megatron", 6)
