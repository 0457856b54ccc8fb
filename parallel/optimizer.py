"""Megatron DDP wrapping and optimizer (Adam), and a step that never applies a non-finite update.

Each RLModel (policy, critic) owns its own optimizer and learning rate. Megatron splits parameters
into dense and expert optimizers (different grad-stat groups) chained together; the grad norm is
the global L2 norm over both. The distributed optimizer is available (parallel.distributed_optimizer)
but its checkpoint state does not work on CPU (Megatron-Core 0.16.1 there: flattened_range sharding is
unsupported and the restored step counter is wrong), so it is meant for GPUs; so is
optimizer CPU offload (parallel.optimizer_offload: Megatron's HybridDeviceOptimizer keeps Adam state and
fp32 master weights on the host and steps them with CPU Adam; it cannot run on a CPU-only torch,
where it is refused in one line).

Learning rate (``LrSchedule``): Megatron's OptimizerParamScheduler (megatron/core/optimizer_param_scheduler.py:215
get_lr) over this model's optimizer steps: linear warm-up from 0 to ``lr`` over ``warmup_steps``, then constant,
linear or cosine decay to ``lr_min`` at the last step. The k-th optimizer step runs at the schedule's step k (the
scheduler is advanced just before it), so step 1 of a warm-up is already lr/warmup, not 0, and the last step is at
lr_min. Its only state is that step count; the run checkpoint keeps it (TrainerState.lr_steps) and a resume sets it.

Step (``guarded_step``): copy main grads -> global grad norm -> if the norm (or the loss) is not
finite, zero the grads and report ``skipped`` without touching parameters or Adam moments; else
clip by ``max_norm / (norm + 1e-6)`` when that is < 1 and apply.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip_grad: float = 1.0
    bf16: bool = False
    distributed: bool = False
    offload: bool = False          # Adam state + fp32 master on the host (GPU only)
    lr_schedule: str = "constant"  # constant | linear | cosine (after the warm-up)
    lr_warmup_steps: int = 0
    lr_min: float = 0.0
    total_steps: int = 1           # optimizer steps of the whole run: where linear/cosine reach lr_min


def wrap_ddp(chunks: list[torch.nn.Module], config, distributed_optimizer: bool = False) -> list[torch.nn.Module]:
    """Megatron DDP per model chunk: fp32 main grads, reduced over DP after the last micro-batch."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=(i > 0)) for i, chunk in enumerate(chunks)]


def build_optimizer(ddp_chunks: list[torch.nn.Module], settings: OptimSettings):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=settings.lr, min_lr=min(settings.lr_min, settings.lr), weight_decay=settings.weight_decay,
        adam_beta1=settings.beta1, adam_beta2=settings.beta2, adam_eps=settings.eps,
        clip_grad=settings.clip_grad, bf16=settings.bf16,
        params_dtype=torch.bfloat16 if settings.bf16 else torch.float32,
        use_distributed_optimizer=settings.distributed,
        optimizer_cpu_offload=settings.offload, optimizer_offload_fraction=1.0 if settings.offload else 0.0)
    return get_megatron_optimizer(config, ddp_chunks)


class LrSchedule:
    """This model's learning rate per optimizer step, through Megatron's OptimizerParamScheduler."""

    def __init__(self, opt, settings: OptimSettings):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        warmup = settings.lr_warmup_steps
        # Megatron asserts warmup < decay steps; a constant schedule never reads the decay length.
        decay = max(settings.total_steps, warmup + 1)
        self.scheduler = OptimizerParamScheduler(
            opt, init_lr=0.0, max_lr=settings.lr, min_lr=min(settings.lr_min, settings.lr), lr_warmup_steps=warmup,
            lr_decay_steps=decay, lr_decay_style=settings.lr_schedule, start_wd=settings.weight_decay,
            end_wd=settings.weight_decay, wd_incr_steps=decay, wd_incr_style="constant")

    @property
    def steps(self) -> int:
        return self.scheduler.num_steps

    def advance(self) -> None:
        """Before an optimizer step: set the lr of the step about to run."""
        self.scheduler.step(1)

    def resume_at(self, steps: int) -> None:
        """Continue a saved run: the lr its next step would have had."""
        self.scheduler.num_steps = 0
        self.scheduler.step(int(steps))


def sub_optimizers(opt) -> list:
    """The Megatron optimizers inside `opt`: a ChainedOptimizer's parts (dense and expert), else `opt` itself."""
    return list(getattr(opt, "chained_optimizers", [opt]))


def optimizer_params(opt) -> list[torch.nn.Parameter]:
    return [p for sub in sub_optimizers(opt) for p in sub.get_parameters()]


def set_lr(opt, lr: float) -> None:
    for sub in sub_optimizers(opt):
        for group in sub.param_groups:
            group["lr"] = lr


def current_lr(opt) -> float:
    return float(sub_optimizers(opt)[0].param_groups[0]["lr"])


@torch.no_grad()
def guarded_step(opt, clip_grad: float, loss_finite: bool = True) -> tuple[bool, float]:
    """(applied, grad_norm). A non-finite loss or grad norm zeroes the grads and applies nothing."""
    from megatron.core.optimizer import optimizer as mopt

    found_inf = bool(opt.prepare_grads())
    grad_norm = float(opt.get_grad_norm())
    if found_inf or not loss_finite or not math.isfinite(grad_norm):
        opt.zero_grad()
        return False, grad_norm
    if clip_grad > 0:
        # Looked up at call time: on CPU the shim replaced it with a CPU-safe version.
        mopt.clip_grad_by_total_norm_fp32(optimizer_params(opt), clip_grad, grad_norm)
    opt.step_with_ready_grads()
    return True, grad_norm


def loss_is_finite(value: float, group=None) -> bool:
    """Agree over `group` (world by default) that the loss is finite: every rank must skip together."""
    from .distributed import comm_device

    flag = torch.tensor([0.0 if math.isfinite(value) else 1.0], device=comm_device())
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, group=group)
    return bool(flag.item() == 0.0)
