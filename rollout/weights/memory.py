"""The weight-sync sender's memory during a push, from the model's HF config alone, and the check of
weight_sync.max_sender_mb against it (docs/weights.md, "Sender memory"). Torch-free: `sao plan`
(parallel/planner/sync_time.py) and the recipe checks of `sao train` and `sao launch` read it.

The export streams (parallel/weights.py): a Megatron tensor is gathered over TP at the turn of its
first HF name, so beyond its own shards a broadcast sender holds at most
- buffers: the two reused flat payloads (one on the wire, one being flattened), each of
  max(bucket, largest tensor): a tensor above the bucket travels alone;
- buckets: the bucket being filled (max(bucket, largest tensor)) and one held-back run of routed-expert
  tensors (at most one bucket: broadcast.py non_expert_first). The views of parameters bucketing.iter_buckets
  holds until they join a run sent from the model's memory cost nothing: the export without a snapshot
  yields views of the parameters only (parallel/weights.py), which live anyway;
- gather: the tensor being gathered, twice (its TP pieces and the merged tensor, or the merged tensor
  and its HF parts: q/k/v, gate/up), plus the HF tensors of the one before still waiting for their turn.
The other senders stream the same export and hold instead
- shard_writes (shard_writes.py): per lane two flat buffers and SHARD_QUEUE_DEPTH + 1 buckets of slices
  (queued, and one being flattened), plus one pending bucket per engine TP rank; a slice is copied out
  of its tensor, so a pending bucket never pins a whole gathered tensor;
- disk (disk.py): the shard being filled, of weight_sync.bucket_mb (safetensors >= 0.8 writes from the
  tensors' own memory, no serialized copy); on a GPU trainer that shard is host memory;
- FP8 engines (rollout.engine_fp8): the float8 copy of the tensor being quantized and its scales,
  plus float32 temporaries of at most max(FP8_TEMP_CHUNK, one block row) (fp8_blocks.py).
A tensor above the bucket travels alone in every method (a bucket, a shard, a pending slice bucket).

The constants below are the buffers' own: fp8_blocks.py and shard_writes.py read them from here, so the
rule and the code it bounds cannot drift apart.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from sao_megatron.core.config import ConfigError
from sao_megatron.core.shape import padded_vocab_size, routed_experts

MIB = 2 ** 20
FP8_BLOCK = 128            # rows and columns of one block-FP8 block (fp8_blocks.BLOCK)
FP8_TEMP_BYTES = 8         # float32 bytes per element the quantizer holds at once (two float32 copies)
FP8_TEMP_CHUNK = 64 * MIB  # the quantizer's bound on those temporaries, unless one block row is larger
SHARD_QUEUE_DEPTH = 2      # buckets a shard-writes lane may have sliced ahead of its wire


def largest_tensor_elements(hf: Mapping[str, Any], tp: int = 1) -> int:
    """Elements of the largest full Megatron tensor the export gathers: the padded embedding or head,
    a fused projection (qkv, or MLA's q_b/kv_b), a fused gate+up (dense, shared or one routed expert),
    a down or output projection, or the router."""
    h = int(hf.get("hidden_size") or 0)
    vocab = padded_vocab_size(int(hf.get("vocab_size") or 0), tp)
    return max(vocab * h, routed_experts(hf) * h, largest_linear_elements(hf))


def largest_linear_elements(hf: Mapping[str, Any]) -> int:
    """Elements of the largest attention or MLP projection (fused qkv and gate+up counted whole): the
    largest tensor an FP8 engine's quantizer sees (embeddings, head and router stay bf16)."""
    h = int(hf.get("hidden_size") or 0)
    heads = int(hf.get("num_attention_heads") or 1)
    kv = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or h // max(heads, 1))
    if hf.get("kv_lora_rank"):
        nope, rope, v = (int(hf.get(k) or 0) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        q_rank, kv_rank = int(hf.get("q_lora_rank") or h), int(hf["kv_lora_rank"])
        sizes = [q_rank * heads * (nope + rope), kv_rank * heads * (nope + v), heads * v * h,
                 h * q_rank, h * (kv_rank + rope)]
    else:
        sizes = [(heads + 2 * kv) * head_dim * h, heads * head_dim * h]
    ffn = [int(hf.get(k) or 0)
           for k in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")]
    ffn.append(int(hf.get("n_shared_experts") or 0) * int(hf.get("moe_intermediate_size") or 0))
    return max(sizes + [2 * f * h for f in ffn])


def widest_row_elements(hf: Mapping[str, Any]) -> int:
    """The largest input dimension of a linear layer the FP8 quantizer sees (its block row's width)."""
    h = int(hf.get("hidden_size") or 0)
    heads = int(hf.get("num_attention_heads") or 1)
    head_dim = int(hf.get("head_dim") or h // max(heads, 1))
    dims = [h, heads * head_dim, heads * int(hf.get("v_head_dim") or 0)]
    dims += [int(hf.get(k) or 0) for k in ("intermediate_size", "moe_intermediate_size", "q_lora_rank",
                                           "kv_lora_rank", "shared_expert_intermediate_size")]
    dims.append(int(hf.get("n_shared_experts") or 0) * int(hf.get("moe_intermediate_size") or 0))
    return -(-max(dims) // FP8_BLOCK) * FP8_BLOCK


def fp8_quantize_bytes(hf: Mapping[str, Any]) -> float:
    """The quantizer's own memory for the largest projection (largest_linear_elements): its float8 copy
    (1 byte per element), the float32 scales (ceil(n/128) * ceil(k/128) <= n*k/128 + k; the chunk's
    amax and masks fit there too) and the float32 temporaries of one chunk of block rows
    (fp8_blocks.quantize_block_fp8: at most max(FP8_TEMP_CHUNK, one block row of the widest input))."""
    elements = largest_linear_elements(hf)
    width = widest_row_elements(hf)
    scales = 4 * (elements // FP8_BLOCK + width + 1)
    return elements + scales + max(FP8_TEMP_CHUNK, FP8_TEMP_BYTES * FP8_BLOCK * width)


@dataclass(frozen=True)
class SenderNeed:
    """Bytes a weight-sync sender holds during a push beyond its own model shards (module docstring)."""

    buffers: float
    buckets: float
    gather: float
    largest: float    # the largest single tensor, bytes
    quantize: float = 0.0   # FP8 engines: the float8 copy, scales and float32 temporaries

    @property
    def total(self) -> float:
        return self.buffers + self.buckets + self.gather + self.quantize


def sender_need(hf: Mapping[str, Any], bucket_bytes: float, element_bytes: int, tp: int = 1,
                method: str = "broadcast", fp8: bool = False, lanes: int = 1, targets: int = 1) -> SenderNeed:
    """`lanes` and `targets` (engine TP ranks) count for shard_writes only."""
    largest = largest_tensor_elements(hf, tp) * element_bytes
    payload = max(bucket_bytes, largest)
    quantize = fp8_quantize_bytes(hf) if fp8 else 0.0
    if method == "shard_writes":
        queued = SHARD_QUEUE_DEPTH + 1   # a lane's buckets of slices: the queued ones and the one being flattened
        return SenderNeed(buffers=2 * lanes * payload, buckets=(queued * lanes + targets) * payload,
                          gather=3 * largest, largest=largest, quantize=quantize)
    if method == "disk":
        return SenderNeed(buffers=0.0, buckets=payload, gather=3 * largest, largest=largest, quantize=quantize)
    return SenderNeed(buffers=2 * payload, buckets=payload + bucket_bytes, gather=3 * largest, largest=largest,
                      quantize=quantize)


def recipe_sender_need(recipe, hf: Mapping[str, Any]) -> SenderNeed:
    """sender_need for the recipe's method, dtype, engines and FP8 setting."""
    ws, roll = recipe.weight_sync, recipe.rollout
    targets = (len(roll.engine_urls) or roll.num_engines) * roll.engine_tp
    return sender_need(hf, ws.bucket_mb * MIB, 4 if recipe.model.dtype == "fp32" else 2, recipe.parallel.tp,
                       ws.method, bool(roll.engine_fp8), min(ws.shard_senders, targets), targets)


def check_sender_memory(recipe, hf: Optional[Mapping[str, Any]] = None) -> Optional[SenderNeed]:
    """Refuse a weight_sync.max_sender_mb below what the streamed export and the recipe's send method
    (broadcast, shard_writes or disk; FP8 quantization included) need. `hf` defaults to model.path's
    config.json; without one (a model still to be created) there is nothing to check: None.
    `sao train` (trainer/entry.py) and `sao launch` (launch/validate.py) call it after the recipe loads."""
    if hf is None:
        config = Path(recipe.model.path) / "config.json"
        if not config.is_file():
            return None
        hf = json.loads(config.read_text())
    ws = recipe.weight_sync
    need = recipe_sender_need(recipe, hf)
    if ws.max_sender_mb * MIB < need.total:
        fp8 = f" + FP8 quantizing {need.quantize / MIB:.1f}" if need.quantize else ""
        raise ConfigError("weight_sync.max_sender_mb",
                          f"{ws.max_sender_mb:g} MiB is below what the {ws.method} sender needs during a push: "
                          f"{need.total / MIB:.1f} MiB (flat buffers {need.buffers / MIB:.1f} + buckets "
                          f"{need.buckets / MIB:.1f} + gathering the largest tensor, "
                          f"{need.largest / MIB:.1f} MiB, {need.gather / MIB:.1f}{fp8})",
                          f"raise it to at least {math.ceil(need.total / MIB)} or lower weight_sync.bucket_mb")
    return need
