"""One pass of Megatron's forward(-backward) schedule over a list of micro-batches (PP/VPP aware).

The per-token loss convention: the loss callback returns a loss already divided by the step's
global token count, so the schedule must *sum* micro-batch losses and DP ranks must *sum* grads.
That is Megatron's ``calculate_per_token_loss=True`` mode (no 1/num_microbatches, no 1/dp scaling),
with our finalize function passing no token count (so grads are not divided again).

Context parallel: the model sees only this rank's positions (context_parallel.py); the loss
callback gets that local output and gathers per-position results back to sequence order.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable, Optional

import torch

from sao_megatron.core.records import TrainBatch

from .context_parallel import ContextParallel


def batch_to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """The batch with every tensor on `device` (the model's; CPU batches stay as they are)."""
    changes = {f.name: getattr(batch, f.name).to(device) for f in fields(batch)
               if isinstance(getattr(batch, f.name), torch.Tensor) and getattr(batch, f.name).device != device}
    return replace(batch, **changes) if changes else batch


def context_local(batch: TrainBatch, cp: ContextParallel) -> TrainBatch:
    """The batch as this CP rank's model sees it: every per-position field (tokens, masks, routes...)
    restricted to the rank's positions; rows and scalars unchanged. The identity without CP."""
    if cp.size == 1:
        return batch
    changes = {f.name: cp.split(getattr(batch, f.name)) for f in fields(batch)
               if isinstance(getattr(batch, f.name), torch.Tensor) and getattr(batch, f.name).dim() >= 2}
    return replace(batch, **changes)


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
                 forward_only: bool = False, cp: Optional[ContextParallel] = None,
                 packed_form: str = "mask") -> list[dict]:
    """Run every micro-batch through the model; return `on_output`'s metric dicts (last stage only).

    Each batch is padded to a multiple of `seq_multiple` (packing.seq_multiple) and cut to this CP
    rank's positions. on_output(index, batch, output) -> (scalar loss, metrics) runs on the last
    stage with the caller's own (unpadded) batch and the model's output [rows, local positions of
    the padded sequence, ...]: the callback gathers over CP and trims to the batch's length.
    `before_forward(chunk_index, local_batch)` runs before each chunk's forward (routing replay)
    with the padded, CP-local batch.

    A batch with `packed` set runs as one packed row (packing.PackedLayout): `packed_form` "thd" hands
    the model Megatron's PackedSeqParams (Transformer Engine), "mask" a block-diagonal causal mask (the
    local spec); its output is [1, packed width, ...] and the callback unpacks it.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cp = cp or ContextParallel()
    chunk_index = {id(c): i for i, c in enumerate(chunks)}
    device = next(chunks[0].parameters()).device
    batches = [batch_to(b, device) for b in batches]
    inputs = [_model_input(b, seq_multiple, cp, packed_form) for b in batches]

    def forward_step(data_iterator, model):
        index, batch = next(data_iterator)
        local, positions, mask, packed_params = inputs[index]
        if before_forward is not None:
            before_forward(chunk_index[id(model)], local)
        extra = {} if packed_params is None else {"packed_seq_params": packed_params}
        output = model(local.tokens, positions, mask, **extra)

        def loss_func(output_tensor):
            loss, metrics = on_output(index, batches[index], output_tensor)
            return loss, torch.tensor(1, dtype=torch.int), metrics

        return output, loss_func

    iterators = [iter(list(enumerate(batches))) for _ in chunks]
    rows = max(int(i[0].tokens.shape[0]) for i in inputs)
    seq = max(int(i[0].tokens.shape[1]) for i in inputs) * cp.size
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(batches), seq_length=seq,
        micro_batch_size=rows, forward_only=forward_only)


def _model_input(batch: TrainBatch, seq_multiple: int, cp: ContextParallel, packed_form: str):
    """(the batch as this rank's model sees it, position ids, attention mask, PackedSeqParams)."""
    from .packing import PackedLayout, pad_seq

    if not batch.packed:
        padded = pad_seq(batch, seq_multiple)
        full = padded.tokens
        positions = cp.split(torch.arange(full.shape[1], device=full.device).unsqueeze(0).expand_as(full))
        return context_local(padded, cp), positions, None, None
    if cp.size > 1:
        raise ValueError(f"parallel.pack_sequences with parallel.cp = {cp.size}: packed rows are not split per "
                         "sample over context-parallel ranks yet; fix: set parallel.pack_sequences = false")
    layout = PackedLayout.of(batch, seq_multiple)
    device = batch.tokens.device
    if packed_form == "thd":
        return layout.pack_batch(batch), layout.positions(device), None, layout.packed_seq_params(device)
    return layout.pack_batch(batch), layout.positions(device), layout.attention_mask(device), None
