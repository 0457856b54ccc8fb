"""Samples -> response-space tensors for the algorithms -> packed TrainBatch micro-batches.

Two index spaces meet here:
- response space ``[B, R]``: position i is response token i of a sample (what advantages use);
- sequence space ``[rows, S]``: position t holds token t of prompt+response (what the model sees);
  response token i of a sample with P prompt tokens sits at t = P + i.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sao_megatron.core.records import Sample, TrainBatch


@dataclass
class ResponseTensors:
    """Per-sample response-space tensors, right-padded to the longest response."""

    mask: torch.Tensor            # [B, R] 1 = action token
    token_rewards: torch.Tensor   # [B, R] the scalar reward on the last action token
    rollout_logprobs: torch.Tensor
    seq_rewards: torch.Tensor     # [B]
    group_ids: torch.Tensor       # [B] long
    action_lengths: torch.Tensor  # [B] action tokens per sample


def response_tensors(samples: list[Sample]) -> ResponseTensors:
    width = max(1, max(len(s.response_ids) for s in samples))
    n = len(samples)
    mask = torch.zeros(n, width)
    rewards = torch.zeros(n, width)
    logps = torch.zeros(n, width)
    for row, sample in enumerate(samples):
        length = len(sample.response_ids)
        mask[row, :length] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        logps[row, :length] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
        actions = mask[row].nonzero()
        if len(actions):  # the reward sits on the last generated token, never on padding after EOS
            rewards[row, int(actions[-1])] = float(sample.reward or 0.0)
    return ResponseTensors(
        mask=mask, token_rewards=rewards, rollout_logprobs=logps,
        seq_rewards=torch.tensor([float(s.reward or 0.0) for s in samples]),
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
        action_lengths=mask.sum(dim=1),
    )


def to_response_space(samples: list[Sample], seq_values: list[torch.Tensor], width: int) -> torch.Tensor:
    """Gather per-sample sequence-space rows ([S_i]) into response space [B, width]."""
    out = torch.zeros(len(samples), width)
    for row, (sample, values) in enumerate(zip(samples, seq_values)):
        start, length = len(sample.prompt_ids), len(sample.response_ids)
        out[row, :length] = values[start:start + length]
    return out


def plan_micro_batches(samples: list[Sample], token_budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches whose padded size rows*max_len fits the budget.

    Longest-first keeps padding low; a sample longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(samples)), key=lambda i: -samples[i].num_tokens)
    groups: list[list[int]] = []
    current: list[int] = []
    current_max = 0
    for index in order:
        length = samples[index].num_tokens
        new_max = max(current_max, length)
        if current and new_max * (len(current) + 1) > token_budget:
            groups.append(current)
            current, new_max = [], length
        current.append(index)
        current_max = new_max
    if current:
        groups.append(current)
    return groups


def build_train_batch(samples: list[Sample], advantages: torch.Tensor, returns: torch.Tensor | None,
                      indices: list[int], *, global_num_tokens: float, global_num_seqs: float,
                      with_routes: bool) -> TrainBatch:
    """One micro-batch in sequence space; `advantages`/`returns` are response-space [B, R] for all samples."""
    rows = [samples[i] for i in indices]
    seq = max(s.num_tokens for s in rows)
    n = len(rows)
    tokens = torch.zeros(n, seq, dtype=torch.long)
    fields = {name: torch.zeros(n, seq) for name in ("loss_mask", "rollout_logprobs", "advantages", "returns")}
    versions = torch.full((n, seq), -1, dtype=torch.long)
    routes = None
    if with_routes and all(s.routed_experts is not None for s in rows):
        layers, topk = rows[0].routed_experts.shape[1:]
        routes = torch.full((n, seq, layers, topk), -1, dtype=torch.int32)
    for r, (sample, index) in enumerate(zip(rows, indices)):
        prompt, length = len(sample.prompt_ids), len(sample.response_ids)
        span = slice(prompt, prompt + length)
        tokens[r, :sample.num_tokens] = torch.tensor(sample.prompt_ids + sample.response_ids)
        fields["loss_mask"][r, span] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        fields["rollout_logprobs"][r, span] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
        fields["advantages"][r, span] = advantages[index, :length]
        if returns is not None:
            fields["returns"][r, span] = returns[index, :length]
        versions[r, span] = torch.tensor(sample.weight_versions, dtype=torch.long)
        if routes is not None:
            routes[r, :sample.num_tokens - 1] = sample.routed_experts
    return TrainBatch(
        tokens=tokens, lengths=torch.tensor([s.num_tokens for s in rows]), weight_versions=versions,
        sample_uids=[s.uid for s in rows], routed_experts=routes,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, **fields,
    )


def build_train_batches(samples: list[Sample], advantages: torch.Tensor, returns: torch.Tensor | None,
                        token_budget: int, with_routes: bool = True) -> list[TrainBatch]:
    mask_tokens = sum(sum(s.loss_mask) for s in samples)
    seqs = sum(1 for s in samples if any(s.loss_mask))
    return [build_train_batch(samples, advantages, returns, group, global_num_tokens=float(mask_tokens),
                              global_num_seqs=float(seqs), with_routes=with_routes)
            for group in plan_micro_batches(samples, token_budget)]


def split_rows(batch: TrainBatch, parts: int) -> list[TrainBatch]:
    """Split one micro-batch by rows into up to `parts` micro-batches (global counts unchanged)."""
    import dataclasses

    bounds = torch.linspace(0, batch.num_rows, min(parts, batch.num_rows) + 1).round().long().tolist()
    out = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        fields = {}
        for f in dataclasses.fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, torch.Tensor):
                value = value[start:stop]
            elif isinstance(value, list):
                value = value[start:stop]
            fields[f.name] = value
        out.append(TrainBatch(**fields))
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
