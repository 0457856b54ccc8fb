"""Indexer replay: DSA layers attend to the keys the engine's indexer chose, and agreement is measured.

DSA's top-k selection is discontinuous, like MoE routing: near-tied index scores flip under float noise,
so the trainer replays the engine's choices as it replays routes (parallel/routing_replay.py). Engine
selections come per sample as int32 ``[tokens - 1, num_hidden_layers, index_topk]`` logical key positions
(-1 = empty slot; checkpoints/arch/dsa.py), one column per hidden layer with "shared" layers mirroring
their full layer, as SGLang 0.5.23 lays them out (configs/model_config.py get_num_indexer_layers). In a
TrainBatch they are ``indexer_topk [rows, seq, num_hidden_layers, index_topk]``, -1 where a position
has none (the last token and padding): such a query attends causally (parallel/mla_attention.py); its
output is never read, since those positions come after every real one.

The core attention sees the whole sequence on every TP rank (heads are split, not positions), so each
layer takes ``[rows, seq, index_topk]`` as it is; context parallelism is refused with DSA.

``train/indexer_agreement`` = share of replayed (token, layer, slot) choices, over valid slots (>= 0),
that the trainer's own indexer also selects for that token and layer; counted on TP rank 0 only (the
other TP ranks compute the same), summed over DP and PP ranks.
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch

from .mla_attention import sparse_layers
from .routing_replay import RouteAgreement

log = logging.getLogger(__name__)


class IndexerAgreement(RouteAgreement):
    """Counts replayed (token, layer, slot) choices the trainer's own indexer also made (the counters and
    their reduction over ranks are routing replay's)."""

    def count(self, replayed: torch.Tensor, own: torch.Tensor) -> None:
        """replayed, own: [b, sq, k] positions (-1 = empty)."""
        from megatron.core import parallel_state

        if parallel_state.get_tensor_model_parallel_rank() != 0:
            return
        valid = replayed >= 0
        hit = (replayed.unsqueeze(-1) == own.unsqueeze(-2)).any(dim=-1) & valid
        self.agree += int(hit.sum())
        self.total += int(valid.sum())


class IndexerReplayer:
    """Sets each DSA layer's selection per micro-batch and model chunk (the RouteReplayer of indexers)."""

    def __init__(self, model_chunks: Iterable[torch.nn.Module], num_layers: int, index_topk: int):
        self.chunks = list(model_chunks)
        self.num_layers, self.index_topk = num_layers, index_topk
        self.agreement = IndexerAgreement()
        self._layers = [sparse_layers(c) for c in self.chunks]
        self._warned = False
        self.needs_replay = _any_rank(any(m.indexer_kind == "shared" and m.source is None
                                          for layers in self._layers for _, m in layers))
        for index, (chunk, layers) in enumerate(zip(self.chunks, self._layers)):
            for _, module in layers:
                module.selection.agreement = self.agreement
            if layers:
                chunk.register_forward_hook(self._arm_backward(index))

    @property
    def active(self) -> bool:
        return any(self._layers)

    def check_batches(self, batches) -> None:
        """Before any collective, on every rank: a layout whose "shared" DSA layer sits on another
        pipeline stage than its full layer can run only on replayed selections."""
        if self.needs_replay and any(b.indexer_topk is None for b in batches):
            raise ValueError("a DSA layer that reuses an earlier layer's indexer selection is on another pipeline "
                             "stage than that layer, and the batch has no indexer_topk to replay; fix: serve with "
                             "--enable-return-indexer-topk, or set parallel.last_stage_layers so a stage starts "
                             "with a full indexer layer")

    def _arm_backward(self, chunk_index: int):
        """Activation recompute re-runs this chunk's forwards during backward: from then on its layers
        take the queued targets of the micro-batch being recomputed."""
        def hook(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._enter_backward(chunk_index))
        return hook

    def _enter_backward(self, chunk_index: int) -> None:
        for _, module in self._layers[chunk_index]:
            module.selection.in_backward = True

    def set_topk(self, chunk_index: int, indexer_topk: Optional[torch.Tensor]) -> None:
        """Replay `indexer_topk` [rows, seq, num_layers, index_topk] in this chunk's DSA layers (layer l
        <- column l); None = the layers select with the trainer's own indexer (said once per run)."""
        layers = self._layers[chunk_index]
        if not layers:
            return
        if indexer_topk is None:
            if not self._warned:
                log.warning("DSA model without the engine's indexer_topk: the trainer selects keys with its own "
                            "indexer, which can differ from the engine's on near-tied scores (serve with "
                            "--enable-return-indexer-topk to replay them)")
                self._warned = True
            for _, module in layers:
                module.selection.set_targets(None)
            return
        check_indexer_topk(indexer_topk, self.num_layers, self.index_topk)
        for layer, module in layers:
            module.selection.set_targets(indexer_topk[:, :, layer].long().contiguous())

    def clear(self) -> None:
        for layers in self._layers:
            for _, module in layers:
                module.selection.clear()


def check_indexer_topk(indexer_topk: torch.Tensor, num_layers: int, index_topk: int) -> None:
    """One line naming the field, the shape wanted and the shape got."""
    shape = tuple(indexer_topk.shape)
    if indexer_topk.dim() != 4 or shape[2] != num_layers or shape[3] != index_topk:
        raise ValueError(f"indexer_topk has shape {shape}; expected [rows, seq, {num_layers}, {index_topk}]: one "
                         f"column per hidden layer and index_topk slots (SGLang's layout); fix: take it from an "
                         f"engine serving this model")
    seq = shape[1]
    if bool(((indexer_topk < -1) | (indexer_topk >= seq)).any()):
        raise ValueError(f"indexer_topk holds positions outside [-1, {seq - 1}] for sequences of {seq} tokens; "
                         f"fix: take it from an engine serving this model (positions are logical, not cache slots)")


def _any_rank(flag: bool) -> bool:
    """True when `flag` holds on any rank (every rank calls it, once, while the model is built)."""
    if not torch.distributed.is_initialized():
        return flag
    from .distributed import comm_device

    value = torch.tensor([1.0 if flag else 0.0], device=comm_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item() > 0)
