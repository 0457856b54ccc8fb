"""`ArchShape`: the numbers of a model that layout rules and the trainer's batch plumbing need.

It lives in the bottom layer because the recipe check (core/config) validates a layout against a
model's config.json and may not import the architecture registry. `shape_from_hf` reads any HF
config dict by key names alone; checkpoints.arch.arch_shape adds what only the family knows (its
name, how many leading layers are dense). A key missing from a partial config reads as 0, and a
layout rule whose count is 0 is skipped (ParallelDims.validate). `padded_vocab_size` is the trainer's
vocabulary padding, here so that the model build (parallel/specs.py) and the weight-sync sender's memory
rule (rollout/weights/memory.py) read one rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# Routed-expert counts under their HF names: DeepSeek/GLM name the routed count explicitly
# (shared experts are separate), Qwen3-MoE calls it num_experts, Mixtral num_local_experts.
EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
VOCAB_PAD_MULTIPLE = 128   # the trainer's embedding and head rows: the vocabulary padded up to a multiple


@dataclass(frozen=True)
class ArchShape:
    """The numbers layout validation needs (ParallelDims.validate) and the trainer reads."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    num_experts: int               # routed experts (Megatron's num_moe_experts); 0 = dense model
    top_k: int
    vocab_size: int
    first_dense_layers: int = 0
    mla: bool = False              # multi-latent attention: no KV-head groups to split over TP

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers


def routed_experts(hf: Mapping[str, Any]) -> int:
    """Routed experts of an HF config (0 for a dense model): the one reading of the three key names."""
    for key in EXPERT_KEYS:
        if hf.get(key):
            return int(hf[key])
    return 0


def padded_vocab_size(vocab: int, tp: int) -> int:
    """Pad to a multiple of 128 (or 128*tp when tp does not divide 128) so every TP shard is equal: the
    rows parallel/model_build.py builds and the weight-sync sender gathers (rollout/weights/memory.py)."""
    multiple = VOCAB_PAD_MULTIPLE if VOCAB_PAD_MULTIPLE % tp == 0 else VOCAB_PAD_MULTIPLE * tp
    return -(-vocab // multiple) * multiple


def is_mla(hf: Mapping[str, Any]) -> bool:
    """Multi-latent attention (DeepSeek-V3, GLM-5): the config has a KV latent rank."""
    return bool(hf.get("kv_lora_rank"))


def shape_from_hf(hf: Mapping[str, Any], arch: str = "") -> ArchShape:
    """The ArchShape of an HF config dict by key names alone; absent counts read as 0."""
    heads = int(hf.get("num_attention_heads") or 0)
    return ArchShape(
        arch=arch or str(hf.get("model_type", "")), num_layers=int(hf.get("num_hidden_layers") or 0),
        hidden_size=int(hf.get("hidden_size") or 0), num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads), num_experts=routed_experts(hf),
        top_k=int(hf.get("num_experts_per_tok") or 0), vocab_size=int(hf.get("vocab_size") or 0),
        mla=is_mla(hf))
