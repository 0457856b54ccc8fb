"""Trainer memory per GPU of one trained model (policy or critic): weights, grads, optimizer, activations."""
from __future__ import annotations

from dataclasses import dataclass

from sao_megatron.core.dims import ParallelDims

from .activations import activation_bytes
from .fp8_memory import fp8_activation_saving, fp8_weight_copy_bytes
from .params import rank_params


@dataclass(frozen=True)
class TrainOptions:
    dtype: str = "bf16"               # parameter dtype of the trainer
    fp8: str = "none"                 # model.fp8: TE FP8 recipe (none | delayed | tensorwise | blockwise | mxfp8)
    recompute: str = "none"           # none | selective | full
    micro_batch_tokens: int = 4096
    kernels: str = "te"               # te (Transformer Engine, GPUs) | local (Megatron local spec, CPU)
    seq_len: int = 0                  # padded row length for local kernels' attention scores (0 = one row)
    distributed_optimizer: bool = True
    optimizer_offload: bool = False   # Adam state and fp32 master on the host (CPU Adam)


@dataclass(frozen=True)
class ModelMemory:
    """Bytes on the worst rank (the stage with the largest sum) of one trained model."""

    stage: int
    params: float
    weights: float
    gradients: float
    optimizer: float
    activations: float
    host: float = 0.0  # optimizer state kept in host memory (CPU offload)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def model_memory(cfg: dict, layout: ParallelDims, world: int, opts: TrainOptions, critic: bool = False,
                 freeze_attention: bool = True) -> ModelMemory:
    """Per-GPU memory of the policy (critic=False) or the critic (value head; SAO frozen attention)."""
    trainable = "moe_only" if critic and freeze_attention else "all"
    per_stage = [_stage_memory(cfg, layout, world, opts, stage, trainable, critic) for stage in range(layout.pp)]
    return max(per_stage, key=lambda m: m.total)


def _stage_memory(cfg, layout, world, opts, stage, trainable, critic) -> ModelMemory:
    p = rank_params(cfg, layout, stage, trainable, value_head=critic)
    b_w = 4 if opts.dtype == "fp32" else 2
    dense_trainable = p.tp_split + p.replicated - p.frozen_dense
    b_opt = 8 if opts.dtype == "fp32" else 12
    dense_shard = layout.data_parallel(world) * layout.cp if opts.distributed_optimizer else 1
    expert_shard = layout.expert_data_parallel(world) if opts.distributed_optimizer else 1
    optimizer = b_opt * (dense_trainable / dense_shard + p.expert / expert_shard)
    acts = activation_bytes(cfg, layout, stage, opts.micro_batch_tokens, opts.recompute, b_w, value_head=critic,
                            kernels=opts.kernels, seq_len=opts.seq_len)
    weights = p.total * b_w
    if opts.fp8 != "none" and opts.kernels == "te":
        # TE's cached FP8 weight copies come on top of the bf16 primary weights; saved linear inputs shrink.
        weights += fp8_weight_copy_bytes(cfg, layout, stage, opts.fp8, value_head=critic)
        acts -= fp8_activation_saving(cfg, layout, stage, opts.micro_batch_tokens, opts.recompute, b_w)
    on_gpu, host = (0.0, optimizer) if opts.optimizer_offload else (optimizer, 0.0)
    return ModelMemory(stage, p.total, weights, (dense_trainable + p.expert) * 4, on_gpu, acts, host)
