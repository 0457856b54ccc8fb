"""One pass of Megatron's forward(-backward) schedule over a list of micro-batches (PP/VPP aware).

The per-token loss convention: the loss callback returns a loss already divided by the step's
global token count, so the schedule must *sum* micro-batch losses and DP ranks must *sum* grads.
That is Megatron's ``calculate_per_token_loss=True`` mode (no 1/num_microbatches, no 1/dp scaling),
with our finalize function passing no token count (so grads are not divided again).
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable, Optional

import torch

from sao_megatron.records import TrainBatch


def batch_to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """The batch with every tensor on `device` (the model's; CPU batches stay as they are)."""
    changes = {f.name: getattr(batch, f.name).to(device) for f in fields(batch)
               if isinstance(getattr(batch, f.name), torch.Tensor) and getattr(batch, f.name).device != device}
    return replace(batch, **changes) if changes else batch


def configure_per_token_loss(config) -> None:
    """Set the TransformerConfig fields the schedule and DDP read (before DDP wrapping)."""
    from megatron.core.distributed import finalize_model_grads

    def finalize(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)

    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = finalize
    config.grad_scale_func = None


def run_schedule(chunks: list[torch.nn.Module], batches: list[TrainBatch], seq_multiple: int,
                 on_output: Callable[[int, TrainBatch, torch.Tensor], tuple[torch.Tensor, dict]],
                 before_forward: Optional[Callable[[int, TrainBatch], None]] = None,
                 forward_only: bool = False) -> list[dict]:
    """Run every micro-batch through the model; return `on_output`'s metric dicts (last stage only).

    on_output(index, batch, output [rows, seq, ...]) -> (scalar loss, metrics) runs on the last
    stage; `before_forward(chunk_index, batch)` runs before each chunk's forward (routing replay).
    Outputs are trimmed back to each batch's own sequence length.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .packing import pad_seq

    chunk_index = {id(c): i for i, c in enumerate(chunks)}
    device = next(chunks[0].parameters()).device
    batches = [batch_to(b, device) for b in batches]
    padded = [pad_seq(b, seq_multiple) for b in batches]

    def forward_step(data_iterator, model):
        index, batch = next(data_iterator)
        if before_forward is not None:
            before_forward(chunk_index[id(model)], padded[index])
        tokens = padded[index].tokens
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        output = model(tokens, positions, None)

        def loss_func(output_tensor):
            seq = batches[index].tokens.shape[1]
            loss, metrics = on_output(index, batches[index], output_tensor[:, :seq])
            return loss, torch.tensor(1, dtype=torch.int), metrics

        return output, loss_func

    iterators = [iter(list(enumerate(batches))) for _ in chunks]
    rows = max(int(b.tokens.shape[0]) for b in padded)
    seq = max(int(b.tokens.shape[1]) for b in padded)
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(batches), seq_length=seq,
        micro_batch_size=rows, forward_only=forward_only)
