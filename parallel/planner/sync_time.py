"""Weight-sync time (trainer -> engines) for the two transports, and the sender's peak memory.

- broadcast: one group spans the sender and every engine GPU; every engine GPU receives every byte, so
  the wire time is the model's bytes over one link (the sender's, and each receiver's, NIC when the
  engines are on other nodes; NVLink when sender and engine share a node).
- sharded: each engine rank receives only its own shard (its TP/EP slice, plus what it replicates:
  attention under dp-attention), from every trainer rank in parallel (each sends its share of what
  its TP group gathered: the engine ranks are dealt among a tensor's holders), each on its own group;
  the wire time is the larger of one engine GPU's bytes over its link and all engine bytes over the
  senders' links together.

Both first gather what the trainer holds sharded: TP pieces over NVLink; for broadcast also the
routed experts over the expert-parallel group (NIC when EP spans nodes); sharded sends each expert
from its owner (no expert gather; `gather_experts=True` models a P2P path that still gathers them, as
miles' does). Stages gather one after the other (ours: per-stage senders send in turns) unless
`stage_parallel_gather` (slime/miles gather every stage at once). Fixed costs: BUCKET_OVERHEAD_S per
bucket a sender sends (HTTP call, CUDA sync) and PER_TENSOR_S per tensor an engine rank loads (one
Python weight_loader call; a broadcast rank loads every tensor, a sharded rank only its own).
Bytes on the wire: bf16, or with rollout.engine_fp8 FP8 blocks + float32 block scales for every weight
but the embedding and head (model_sent_bytes); the gather before it moves bf16 either way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..model_shapes import all_layers, count_parameters, embedding_params, head_params, is_mla, num_experts
from .engine import engine_memory
from .hardware import BUCKET_OVERHEAD_S, LINK_EFF, PER_TENSOR_S, GpuSpec, gpu_spec

TRANSPORTS = ("broadcast", "sharded")
SENT_BYTES = 2  # the trainer's bf16 weights: what it gathers, and what it sends a bf16 engine
# An FP8 engine (rollout.engine_fp8) is sent float8 128x128 blocks plus one float32 scale per block
# (rollout/weights/fp8_blocks.py) for every weight but the embedding and head; the gather stays bf16.
FP8_SENT_BYTES = 1 + 4 / (128 * 128)


def model_sent_bytes(cfg: dict, fp8: bool) -> float:
    """Bytes of one copy of the model on the wire: bf16, or FP8 blocks + scales with bf16 embedding/head
    (norms and routers counted as FP8 too: a rounding error, as in the engine's memory)."""
    total = count_parameters(cfg).total
    if not fp8:
        return total * SENT_BYTES
    vocab = embedding_params(cfg) + head_params(cfg)
    return vocab * SENT_BYTES + (total - vocab) * FP8_SENT_BYTES


@dataclass(frozen=True)
class SyncTime:
    transport: str
    bytes_total: float       # bytes leaving the trainer side (broadcast: one copy of the model)
    bytes_per_engine_gpu: float
    senders: int
    gather: float            # seconds
    wire: float
    overhead: float

    @property
    def total(self) -> float:
        return self.gather + self.wire + self.overhead


def _link(spec: GpuSpec, crosses_nodes: bool) -> float:
    return (spec.nic_bytes if crosses_nodes else spec.nvlink_bytes) * LINK_EFF


def engine_gpu_bytes(inp) -> float:
    """Bytes one engine GPU receives: its expert slice plus its attention-TP slice of everything else
    (whole under dp-attention), in bf16, or with engine_fp8 as the engine holds them (FP8 linear
    weights) plus their block scales (an upper bound: the scales counted on every byte)."""
    cap = 1e30  # capacity is irrelevant here; only the weights are read
    fp8 = inp.engine.fp8_weights
    weights = engine_memory(inp.cfg, replace(inp.engine, fp8_weights=fp8), cap).weights
    return weights * FP8_SENT_BYTES if fp8 else weights


def hf_tensor_counts(cfg: dict) -> tuple[int, int]:
    """(non-expert, routed-expert) HF tensors of the model: what the sender sends one by one."""
    attention = 7 if is_mla(cfg) else 4 + (3 if cfg.get("attention_bias") else 0)
    attention += 5 if cfg.get("index_n_heads") else 0
    dense, expert = 3, 0                           # embedding, final norm, head
    for layer in all_layers(cfg):
        dense += attention + 2 + (3 if layer.dense_mlp else 0) + (3 if layer.shared_experts else 0)
        dense += 2 if layer.router else 0
        expert += 3 * num_experts(cfg) if layer.routed_experts else 0
    return dense, expert


def gather_seconds(inp, transport: str, stage_parallel: bool, gather_experts: bool | None = None) -> float:
    """Trainer-side gather before sending: dense TP pieces over NVLink; for broadcast (or
    gather_experts) the routed experts over the expert-parallel group too."""
    spec, lay = gpu_spec(inp.gpu.name), inp.layout
    counts = count_parameters(inp.cfg)
    dense = (counts.total - counts.routed_experts) * SENT_BYTES
    seconds = dense * (1 - 1 / lay.tp) / _link(spec, False)
    if gather_experts or (gather_experts is None and transport == "broadcast"):
        ep_group = lay.ep * lay.etp
        crosses = lay.tp * ep_group > max(inp.gpus_per_node, 1)
        seconds += counts.routed_experts * SENT_BYTES * (1 - 1 / ep_group) / _link(spec, crosses)
    return seconds / lay.pp if stage_parallel else seconds


def sync_time(inp, transport: str = "broadcast", bucket_bytes: float = 2 ** 30, stage_parallel_gather: bool = False,
              gather_experts: bool | None = None, senders: int = 0) -> SyncTime:
    """Seconds of one weight sync of `inp`'s model to all of its engines (senders: sharded only)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r} is unknown; use one of {', '.join(TRANSPORTS)}")
    spec = gpu_spec(inp.gpu.name)
    engine_gpus = inp.rollout_gpus or inp.gpus
    per_node = max(inp.gpus_per_node, 1)
    crosses = inp.rollout_gpus > 0 or engine_gpus > per_node or inp.engine.tp > per_node
    link = _link(spec, crosses)
    model_bytes = model_sent_bytes(inp.cfg, inp.engine.fp8_weights)
    per_gpu = engine_gpu_bytes(inp)
    if transport == "broadcast":
        senders, wire = 1, model_bytes / link
        per_sender = model_bytes
    else:
        # default: every trainer rank sends its share of what its TP group gathered (parallel/weights.py,
        # scope "shares"): a replicated tensor leaves from all its holders, an expert from its EP slice's
        senders = senders or max(inp.gpus - inp.rollout_gpus, 1)
        received = per_gpu * engine_gpus
        wire = max(per_gpu / link, received / (senders * link))
        per_sender = received / senders
    dense_tensors, expert_tensors = hf_tensor_counts(inp.cfg)
    per_rank = dense_tensors + expert_tensors * (1 if transport == "broadcast" else 1 / max(inp.engine.ep, 1))
    overhead = math.ceil(per_sender / bucket_bytes) * BUCKET_OVERHEAD_S + per_rank * PER_TENSOR_S
    gather = gather_seconds(inp, transport, stage_parallel_gather, gather_experts)
    return SyncTime(transport, model_bytes if transport == "broadcast" else per_gpu * engine_gpus, per_gpu,
                    senders, gather, wire, overhead)


@dataclass(frozen=True)
class SenderMemory:
    """Bytes a weight-sync sender holds on its GPU during a sync, beyond its own model shards: what the
    streamed export and the recipe's send method need (rollout/weights/memory.py),
    capped by weight_sync.max_sender_mb (a recipe whose bound is below the need is refused: `refused`)."""

    buffers: float    # flat payloads of max(bucket, largest tensor): two (broadcast), two per lane (shard_writes)
    buckets: float    # broadcast: the bucket being filled + one held-back expert run; shard_writes: three per
                      # lane + one pending per engine TP rank; disk: the shard being filled
    gather: float     # the tensor being gathered (TP pieces + merged: 2x) + the previous one's waiting HF parts,
                      # and with FP8 engines the quantizer's float8 copy, scales and float32 temporaries
    bound: float      # weight_sync.max_sender_mb in bytes

    @property
    def need(self) -> float:
        return self.buffers + self.buckets + self.gather

    @property
    def total(self) -> float:
        return min(self.bound, self.need)

    @property
    def refused(self) -> bool:
        return self.bound < self.need


def sender_memory(inp, bucket_bytes: float, bound: float = float("inf")) -> SenderMemory:
    """The export streams (parallel/weights.py): a Megatron tensor is gathered over TP at the turn of its
    first HF name and sent in buckets (or shards, or per-rank slices), so the sender holds flat buffers,
    buckets and about three times the largest tensor, whatever the stage's size; in the trainer's dtype
    (the export's)."""
    from rollout.weights.memory import sender_need

    element_bytes = 4 if inp.train.dtype == "fp32" else 2
    targets = max((inp.rollout_gpus or inp.gpus) // max(inp.engine.tp, 1), 1) * inp.engine.tp
    need = sender_need(inp.cfg, bucket_bytes, element_bytes, inp.layout.tp, inp.sync_method,
                       bool(inp.engine.fp8_weights), min(inp.shard_senders, targets), targets)
    return SenderMemory(need.buffers, need.buckets, need.gather + need.quantize, bound)
