"""The weight-sync sender's memory during a push, from the model's HF config alone, and the check of
weight_sync.max_sender_mb against it (docs/weights.md, "Sender memory").

The export streams (parallel/weights.py): a Megatron tensor is gathered over TP at the turn of its
first HF name, so beyond its own shards a broadcast sender holds at most
- buffers: the two reused flat payloads (one on the wire, one being flattened), each of
  max(bucket, largest tensor): a tensor above the bucket travels alone;
- buckets: the bucket being filled (max(bucket, largest tensor)) and one held-back run of routed-expert
  tensors (at most one bucket: rollout/weights/sync.py non_expert_first);
- gather: the tensor being gathered, twice (its TP pieces and the merged tensor, or the merged tensor
  and its HF parts: q/k/v, gate/up), plus the HF tensors of the one before still waiting for their turn.
It lives in the bottom layer because the recipe check (recipe.py) runs it against config.json; the
planner (parallel/planner/sync_time.py) prints the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ConfigError

MIB = 2 ** 20
VOCAB_PAD_MULTIPLE = 128   # as parallel/specs.py pads the vocabulary (times tp when tp does not divide it)


def _padded_vocab(vocab: int, tp: int) -> int:
    multiple = VOCAB_PAD_MULTIPLE if VOCAB_PAD_MULTIPLE % tp == 0 else VOCAB_PAD_MULTIPLE * tp
    return -(-vocab // multiple) * multiple


def largest_tensor_elements(hf: Mapping[str, Any], tp: int = 1) -> int:
    """Elements of the largest full Megatron tensor the export gathers: the padded embedding or head,
    a fused projection (qkv, or MLA's q_b/kv_b), a fused gate+up (dense, shared or one routed expert),
    a down or output projection, or the router."""
    h = int(hf.get("hidden_size") or 0)
    heads = int(hf.get("num_attention_heads") or 1)
    kv = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or h // max(heads, 1))
    sizes = [_padded_vocab(int(hf.get("vocab_size") or 0), tp) * h]
    if hf.get("kv_lora_rank"):
        nope, rope, v = (int(hf.get(k) or 0) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        q_rank, kv_rank = int(hf.get("q_lora_rank") or h), int(hf["kv_lora_rank"])
        sizes += [q_rank * heads * (nope + rope), kv_rank * heads * (nope + v), heads * v * h,
                  h * q_rank, h * (kv_rank + rope)]
    else:
        sizes += [(heads + 2 * kv) * head_dim * h, heads * head_dim * h]
    ffn = [int(hf.get(k) or 0) for k in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")]
    ffn.append(int(hf.get("n_shared_experts") or 0) * int(hf.get("moe_intermediate_size") or 0))
    sizes += [2 * f * h for f in ffn]
    experts = max(int(hf.get(k) or 0) for k in ("n_routed_experts", "num_experts", "num_local_experts"))
    sizes.append(experts * h)
    return max(sizes)


@dataclass(frozen=True)
class SenderNeed:
    """Bytes a broadcast sender holds during a push beyond its own model shards (module docstring)."""

    buffers: float
    buckets: float
    gather: float
    largest: float    # the largest single tensor, bytes

    @property
    def total(self) -> float:
        return self.buffers + self.buckets + self.gather


def sender_need(hf: Mapping[str, Any], bucket_bytes: float, element_bytes: int, tp: int = 1) -> SenderNeed:
    largest = largest_tensor_elements(hf, tp) * element_bytes
    payload = max(bucket_bytes, largest)
    return SenderNeed(buffers=2 * payload, buckets=payload + bucket_bytes, gather=3 * largest, largest=largest)


def check_sender_budget(recipe, hf: Mapping[str, Any]) -> SenderNeed:
    """Refuse a weight_sync.max_sender_mb below what the streamed export and the broadcast send need."""
    ws = recipe.weight_sync
    element_bytes = 4 if recipe.model.dtype == "fp32" else 2
    need = sender_need(hf, ws.bucket_mb * MIB, element_bytes, recipe.parallel.tp)
    if ws.method == "broadcast" and ws.max_sender_mb * MIB < need.total:
        raise ConfigError("weight_sync.max_sender_mb",
                          f"{ws.max_sender_mb:g} MiB is below what the sender needs during a push: "
                          f"{need.total / MIB:.1f} MiB (flat buffers {need.buffers / MIB:.1f} + buckets "
                          f"{need.buckets / MIB:.1f} + gathering the largest tensor, "
                          f"{need.largest / MIB:.1f} MiB, {need.gather / MIB:.1f})",
                          f"raise it to at least {math.ceil(need.total / MIB)} or lower weight_sync.bucket_mb")
    return need
