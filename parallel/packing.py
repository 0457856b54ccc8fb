"""How a micro-batch's rows sit in the model's input: the padding multiple and the packed layout.

The micro-batches themselves are made by the trainer (sao_megatron/trainer/batching.py `pack_samples`:
rows by token budget, and the action-token counts the loss divides by). Here: `seq_multiple`, the
multiple every padded sequence length must be (the splits of the sequence over ranks must be even, and
FP8 GEMMs need whole blocks of tokens), `pad_seq` to reach it, and `PackedLayout`, the rows of a
micro-batch back to back in one row (parallel.pack_sequences).
"""
from __future__ import annotations

from dataclasses import fields, replace

import math

import torch

from sao_megatron.core.records import TrainBatch

_ROW_FIELDS = ("tokens", "lengths", "loss_mask", "rollout_logprobs", "advantages", "returns", "weight_versions",
               "old_logprobs", "ref_logprobs", "old_values", "routed_experts", "indexer_topk")
_MINUS_ONE_PAD = ("routed_experts", "indexer_topk")   # -1 = no route / empty indexer slot


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def seq_multiple(tp: int = 1, sequence_parallel: bool = False, cp: int = 1, fp8: str = "none") -> int:
    """The multiple every micro-batch's padded sequence length must be.

    - sequence parallel: Megatron splits the sequence evenly over the tp ranks;
    - context parallel: 2*cp equal chunks (context_parallel.py), each then split over tp under SP;
    - FP8 (model.fp8 != none): Transformer Engine's FP8 GEMMs need the token count of every GEMM a
      multiple of 8 (16 is the safe value Megatron pads to; 32 for mxfp8's 32-element blocks,
      megatron/core/models/multimodal/context_parallel.py get_padding). Every rank's own slice of
      the sequence (seq / (cp * tp under SP)) is made a whole number of such blocks, so it holds
      whether TE quantizes before or after the sequence-parallel all-gather.
    """
    split = (tp if sequence_parallel else 1) * cp
    even = split * (2 if cp > 1 else 1)
    if fp8 in ("none", "", None):
        return even
    block = 32 if fp8 == "mxfp8" else 16
    return math.lcm(even, split * block)


def slice_rows(batch: TrainBatch, rows: slice, seq_len: int) -> TrainBatch:
    """Rows `rows` of `batch`, trimmed or padded to `seq_len` positions (pad: token 0, masks 0, routes and indexer slots -1)."""
    out = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if f.name in _ROW_FIELDS and isinstance(value, torch.Tensor):
            part = value[rows]
            if part.dim() >= 2:
                part = _fit(part, seq_len, -1 if f.name in _MINUS_ONE_PAD else 0)
            out[f.name] = part
        elif f.name == "sample_uids":
            out[f.name] = list(value[rows])
        else:
            out[f.name] = value
    return TrainBatch(**out)


def _fit(t: torch.Tensor, seq_len: int, pad_value) -> torch.Tensor:
    if t.shape[1] >= seq_len:
        return t[:, :seq_len].contiguous()
    pad = t.new_full((t.shape[0], seq_len - t.shape[1], *t.shape[2:]), pad_value)
    return torch.cat([t, pad], dim=1)


def pad_seq(batch: TrainBatch, seq_multiple: int) -> TrainBatch:
    """Pad the sequence dimension to a multiple of `seq_multiple`."""
    seq = round_up(int(batch.tokens.shape[1]), seq_multiple)
    if seq == batch.tokens.shape[1]:
        return batch
    return slice_rows(batch, slice(None), seq)


class PackedLayout:
    """Where each row's real tokens sit when a micro-batch runs packed (parallel.pack_sequences): the rows'
    first `lengths[r]` positions back to back in one row, then padding up to `width` (a multiple of
    packing.seq_multiple), which forms a segment of its own so no real token ever attends to it.

    Two forms of the same thing (RLModel.packed_form picks one per model): THD with cu_seqlens (Megatron's
    PackedSeqParams; Attention applies RoPE per sample from cu_seqlens and the core attention, TE's or
    parallel/packed_attention.py's, attends within each segment), or, for MLA on the local spec, a
    block-diagonal causal attention mask [1, 1, W, W] (Megatron's convention: True = masked out) that
    parallel/mla_attention.py applies; there RoPE sees positions start_r.. (GPTModel ignores position_ids for
    RoPE, gpt_model.py:361-368), equal up to rounding because RoPE scores depend on position differences.
    """

    def __init__(self, lengths: list[int], seq_multiple: int = 1):
        self.lengths = [int(n) for n in lengths]
        self.starts = [0]
        for n in self.lengths[:-1]:
            self.starts.append(self.starts[-1] + n)
        self.real = sum(self.lengths)
        self.width = max(round_up(self.real, seq_multiple), seq_multiple)

    @classmethod
    def of(cls, batch: TrainBatch, seq_multiple: int = 1) -> "PackedLayout":
        return cls(batch.lengths.tolist(), seq_multiple)

    def segments(self) -> list[int]:
        """Segment lengths in order; the padding tail (if any) is the last segment."""
        return self.lengths + ([self.width - self.real] if self.width > self.real else [])

    def segment_ids(self, device=None) -> torch.Tensor:
        """long [width]: which segment each packed position belongs to."""
        return torch.repeat_interleave(torch.arange(len(self.segments()), device=device),
                                       torch.tensor(self.segments(), device=device))

    def attention_mask(self, device=None) -> torch.Tensor:
        """bool [1, 1, W, W], True = masked: a query sees keys of its own segment at or before it."""
        seg = self.segment_ids(device)
        causal = torch.ones(self.width, self.width, dtype=torch.bool, device=device).tril()
        return ~(causal & (seg.unsqueeze(0) == seg.unsqueeze(1))).view(1, 1, self.width, self.width)

    def positions(self, device=None) -> torch.Tensor:
        """long [1, W]: position within its own segment (restarting per sample)."""
        starts = torch.tensor([0] + list(torch.tensor(self.segments()).cumsum(0)[:-1]), device=device)
        seg = self.segment_ids(device)
        return (torch.arange(self.width, device=device) - starts[seg]).unsqueeze(0)

    def packed_seq_params(self, device=None):
        """Megatron's THD PackedSeqParams (cu_seqlens over every segment, the padding tail included)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor([0] + self.segments(), dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
        longest = max(self.segments())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=longest, max_seqlen_kv=longest)

    def pack(self, t: torch.Tensor, pad_value=0) -> torch.Tensor:
        """[rows, seq, ...] -> [1, width, ...]: each row's real positions back to back, then `pad_value`."""
        parts = [t[r, :n] for r, n in enumerate(self.lengths)]
        tail = t.new_full((self.width - self.real, *t.shape[2:]), pad_value)
        return torch.cat(parts + [tail]).unsqueeze(0)

    def unpack(self, t: torch.Tensor, seq: int, first_zero: bool = False) -> torch.Tensor:
        """[1, width, ...] -> [rows, seq, ...] right-padded with zeros. `first_zero`: position 0 of every row
        is 0 (a result at t that comes from the hidden state at t - 1 would read the previous sample there)."""
        out = t.new_zeros((len(self.lengths), seq, *t.shape[2:]))
        for r, (start, n) in enumerate(zip(self.starts, self.lengths)):
            out[r, :n] = t[0, start:start + n]
        if first_zero:
            out[:, 0] = 0
        return out

    def pack_batch(self, batch: TrainBatch) -> TrainBatch:
        """The batch as the model runs it packed: one row; routes re-laid in packed order (-1 on padding), and
        DSA indexer selections (each row's own key positions) moved by the row's start in the packed row."""
        changes = {}
        for f in fields(batch):
            value = getattr(batch, f.name)
            if f.name in _ROW_FIELDS and isinstance(value, torch.Tensor) and value.dim() >= 2:
                if f.name == "indexer_topk":
                    start = torch.tensor(self.starts, dtype=value.dtype).view(-1, *[1] * (value.dim() - 1))
                    value = torch.where(value >= 0, value + start.to(value.device), value)
                changes[f.name] = self.pack(value, -1 if f.name in _MINUS_ONE_PAD else 0)
        changes["lengths"] = torch.tensor([self.real], device=batch.lengths.device)
        return replace(batch, **changes)
