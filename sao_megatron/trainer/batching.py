"""Samples -> TrainBatch micro-batches, packed once; values and advantages attach through the index.

Two index spaces meet here:
- response space ``[B, R]``: position i is response token i of a sample (what advantages use);
- sequence space ``[rows, S]``: position t holds token t of prompt+response (what the model sees);
  response token i of a sample with P prompt tokens sits at t = P + i.

`pack_samples` builds the micro-batches once and records where each sample landed (a `Slot`:
batch, row, and its response span). Critic values computed on those batches come back to response
space through the index (`gather_responses`); advantages, returns and old values go the other way
(`with_advantages`), into new batches (records are never changed after construction).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

from sao_megatron.core.records import AdvantageBatch, Sample, TrainBatch, action_counts


@dataclass(frozen=True)
class Slot:
    """Where one sample sits: row `row` of micro-batch `batch`, its response at [start, start + length)."""

    batch: int
    row: int
    start: int     # = len(prompt_ids)
    length: int    # = len(response_ids)


@dataclass(frozen=True)
class PackedSamples:
    """One step's micro-batches and, per sample (in the order given), where it sits in them."""

    batches: list[TrainBatch]
    slots: list[Slot]

    @property
    def response_width(self) -> int:
        return max(1, max(slot.length for slot in self.slots))


def advantage_batch(samples: list[Sample], values: Optional[torch.Tensor] = None,
                    baseline: Optional[float] = None) -> AdvantageBatch:
    """The samples in response space, right-padded to the longest response; `values` [B, R] or None."""
    width = max(1, max(len(s.response_ids) for s in samples))
    mask = torch.zeros(len(samples), width)
    rewards = torch.zeros(len(samples), width)
    for row, sample in enumerate(samples):
        mask[row, :len(sample.response_ids)] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        actions = mask[row].nonzero()
        if len(actions):  # the reward sits on the last generated token, never on padding after EOS
            rewards[row, int(actions[-1])] = float(sample.reward or 0.0)
    return AdvantageBatch(
        token_rewards=rewards, mask=mask, values=None if values is None else values * mask,
        seq_rewards=torch.tensor([float(s.reward or 0.0) for s in samples]),
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
        response_lengths=mask.sum(dim=1), baseline=baseline)


def plan_micro_batches(samples: list[Sample], token_budget: int, packed: bool = False) -> list[list[int]]:
    """Group sample indices into micro-batches that fit the budget: padded rows cost rows*max_len, packed
    rows (parallel.pack_sequences) their real tokens.

    Longest-first keeps padding low; a sample longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(samples)), key=lambda i: -samples[i].num_tokens)
    groups: list[list[int]] = []
    current: list[int] = []
    current_max = current_sum = 0
    for index in order:
        length = samples[index].num_tokens
        new_max = max(current_max, length)
        cost = current_sum + length if packed else new_max * (len(current) + 1)
        if current and cost > token_budget:
            groups.append(current)
            current, new_max, current_sum = [], length, 0
        current.append(index)
        current_max, current_sum = new_max, current_sum + length
    if current:
        groups.append(current)
    return groups


def mini_batch_ranges(num_samples: int, mini_batches: int) -> list[range]:
    """The samples of each optimizer step of a rollout batch: `mini_batches` contiguous ranges whose sizes
    differ by at most one (fewer when there are fewer samples)."""
    parts = max(1, min(mini_batches, num_samples))
    bounds = [num_samples * k // parts for k in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def pack_samples(samples: list[Sample], token_budget: int, with_routes: bool = True,
                 packed: bool = False, mini_batches: int = 1) -> PackedSamples:
    """The step's micro-batches (advantages and returns still zero) and each sample's slot in them;
    every batch carries the step's action-token and sequence counts (the loss denominators).
    ``with_routes``: carry the engine's routes and DSA indexer choices (when every sample has them).
    ``packed`` (parallel.pack_sequences): the budget counts real tokens and the model runs each
    micro-batch's rows back to back (TrainBatch.packed; the rows stay right-padded here).
    ``mini_batches`` (algorithm.mini_batches): the samples are split first (mini_batch_ranges), each part
    packed on its own and its micro-batches tagged TrainBatch.mini_batch, so a batch that fits one
    micro-batch still gives that many optimizer steps."""
    batches, slots = [], [None] * len(samples)
    for part, indices in enumerate(mini_batch_ranges(len(samples), mini_batches)):
        for group in plan_micro_batches([samples[i] for i in indices], token_budget, packed):
            rows = [indices[j] for j in group]
            for row, index in enumerate(rows):
                sample = samples[index]
                slots[index] = Slot(len(batches), row, len(sample.prompt_ids), len(sample.response_ids))
            batches.append(replace(_sequence_rows([samples[i] for i in rows], with_routes), packed=packed,
                                   mini_batch=part))
    return PackedSamples(with_counts(batches), slots)


def _sequence_rows(rows: list[Sample], with_routes: bool) -> TrainBatch:
    """One micro-batch of whole samples in sequence space, right-padded to its longest row."""
    seq, n = max(s.num_tokens for s in rows), len(rows)
    tokens = torch.zeros(n, seq, dtype=torch.long)
    mask, logps = torch.zeros(n, seq), torch.zeros(n, seq)
    versions = torch.full((n, seq), -1, dtype=torch.long)
    routes = _per_position(rows, "routed_experts", seq) if with_routes else None
    indexer = _per_position(rows, "indexer_topk", seq) if with_routes else None
    for r, sample in enumerate(rows):
        span = slice(len(sample.prompt_ids), sample.num_tokens)
        tokens[r, :sample.num_tokens] = torch.tensor(sample.prompt_ids + sample.response_ids)
        mask[r, span] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        logps[r, span] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
        versions[r, span] = torch.tensor(sample.weight_versions, dtype=torch.long)
    return TrainBatch(tokens=tokens, lengths=torch.tensor([s.num_tokens for s in rows]), loss_mask=mask,
                      rollout_logprobs=logps, advantages=torch.zeros(n, seq), returns=torch.zeros(n, seq),
                      weight_versions=versions, sample_uids=[s.uid for s in rows], routed_experts=routes,
                      indexer_topk=indexer)


def _per_position(rows: list[Sample], name: str, seq: int):
    """int32 [rows, seq, layers, k] of each sample's `name` ([tokens - 1, layers, k]) at positions
    0..tokens-2, -1 elsewhere; None unless every sample has it (a batch replays all or nothing)."""
    values = [getattr(s, name) for s in rows]
    if any(v is None for v in values):
        return None
    layers, k = values[0].shape[1:]
    out = torch.full((len(rows), seq, layers, k), -1, dtype=torch.int32)
    for r, (sample, value) in enumerate(zip(rows, values)):
        out[r, :sample.num_tokens - 1] = value
    return out


def with_counts(batches: list[TrainBatch]) -> list[TrainBatch]:
    """The batches, each told the action-token and sequence counts of all of them together."""
    tokens, seqs = action_counts(batches)
    return [replace(b, global_num_tokens=tokens, global_num_seqs=seqs) for b in batches]


def gather_responses(packed: PackedSamples, per_batch: list[torch.Tensor]) -> torch.Tensor:
    """Per-batch sequence-space tensors ([rows, S] each) -> response space [B, R] through the index."""
    out = torch.zeros(len(packed.slots), packed.response_width)
    for i, slot in enumerate(packed.slots):
        out[i, :slot.length] = per_batch[slot.batch][slot.row, slot.start:slot.start + slot.length]
    return out


def with_advantages(packed: PackedSamples, advantages: torch.Tensor, returns: Optional[torch.Tensor],
                    old_values: Optional[torch.Tensor]) -> list[TrainBatch]:
    """New batches carrying the response-space [B, R] advantages, returns and old values of each sample."""
    per_field = {"advantages": advantages, "returns": returns, "old_values": old_values}
    out = []
    for b, batch in enumerate(packed.batches):
        rows = [(i, s) for i, s in enumerate(packed.slots) if s.batch == b]
        changes = {name: _scatter(batch.returns, rows, values) for name, values in per_field.items()
                   if values is not None}
        out.append(replace(batch, **changes))
    return out


def _scatter(like: torch.Tensor, rows: list[tuple[int, Slot]], values: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for index, slot in rows:
        out[slot.row, slot.start:slot.start + slot.length] = values[index, :slot.length]
    return out


def split_rows(batch: TrainBatch, parts: int) -> list[TrainBatch]:
    """Split one micro-batch by rows into up to `parts` micro-batches (global counts unchanged)."""
    bounds = torch.linspace(0, batch.num_rows, min(parts, batch.num_rows) + 1).round().long().tolist()
    out = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        sliced = {f.name: getattr(batch, f.name)[start:stop] for f in fields(batch)
                  if isinstance(getattr(batch, f.name), (torch.Tensor, list))}
        out.append(replace(batch, **sliced))
    return out


def shard_for_data_parallel(batches: list[TrainBatch], dp_rank: int, dp_size: int) -> list[TrainBatch]:
    """This DP rank's micro-batches: every rank gets at least one (the largest are split by rows)."""
    if dp_size == 1:
        return batches
    batches = list(batches)
    while len(batches) < dp_size:
        largest = max(range(len(batches)), key=lambda i: batches[i].num_rows)
        if batches[largest].num_rows < 2:
            raise ValueError(f"{sum(b.num_rows for b in batches)} samples cannot feed {dp_size} data-parallel "
                             "ranks; fix: raise rollout.batch_size to at least the data-parallel size")
        batches[largest:largest + 1] = split_rows(batches[largest], 2)
    return batches[dp_rank::dp_size]
