"""What the last pipeline stage computed, on every stage and DP rank of the model.

- `broadcast_from_last_stage`: per-micro-batch tensors (logprobs and entropy, values) copied from the
  last stage to every stage, on the CPU where the trainer keeps them.
- `reduce_step_metrics`: a train step's loss metrics over every micro-batch and DP rank, by the algorithm
  library's rules (`combine_metrics`): sums, except `*_max` (max) and `*_min` (min), and
  `vf_explained_var` recomputed from the step's summed moments.
"""
from __future__ import annotations

import math

import torch

from .distributed import comm_device


def _pp_group_and_last():
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    return group, last, parallel_state.get_pipeline_model_parallel_world_size()


def broadcast_from_last_stage(store: list, shapes: list, keys: tuple) -> list[dict]:
    """Tensors computed on the last pipeline stage, copied to every stage."""
    group, last, size = _pp_group_and_last()
    out = []
    for i, shape in enumerate(shapes):
        item = {}
        for key in keys:
            tensor = store[i][key].detach().float().contiguous() if store else torch.empty(tuple(shape), device=comm_device())
            if size > 1:
                torch.distributed.broadcast(tensor, src=last, group=group)
            item[key] = tensor.cpu()  # the trainer's tensors live on the CPU
        out.append(item)
    return out


def reduce_step_metrics(store: list) -> dict[str, float]:
    """The step's metrics over every micro-batch of the last stage and every DP rank, by the algorithm
    library's rules (combine_metrics): sums, except ``*_max`` (max) and ``*_min`` (min); then
    ``vf_explained_var`` recomputed from the summed moments of the whole step (finalize_metrics)."""
    from megatron.core import parallel_state

    from sao_megatron.algorithms import combine_metrics, finalize_metrics

    group, last, size = _pp_group_and_last()
    summed = combine_metrics(store or [])
    if size > 1:
        box = [summed]
        torch.distributed.broadcast_object_list(box, src=last, group=group)
        summed = box[0]
    if parallel_state.get_data_parallel_world_size() > 1 and summed:
        summed = all_reduce_metrics(summed, parallel_state.get_data_parallel_group())
    summed = finalize_metrics(summed)
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in summed.items()}


def all_reduce_metrics(metrics: dict[str, float], group) -> dict[str, float]:
    """combine_metrics across ranks: one SUM all-reduce for the additive keys, one MAX for ``*_max`` and
    the negated ``*_min``. Every rank holds the same keys (the same loss on the same step)."""
    from sao_megatron.algorithms import reduction

    keys = sorted(metrics)
    sign = [-1.0 if reduction(k) == "min" else 1.0 for k in keys]
    extreme = [reduction(k) != "sum" for k in keys]
    vec = torch.tensor([metrics[k] * s for k, s in zip(keys, sign)], dtype=torch.float64, device=comm_device())
    is_extreme = torch.tensor(extreme, device=vec.device)
    total, top = vec.clone(), vec.clone()
    torch.distributed.all_reduce(total, group=group)
    torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
    out = torch.where(is_extreme, top, total).cpu().tolist()
    return {k: v * s for k, v, s in zip(keys, out, sign)}
