"""Samples -> packed micro-batches (once, with a slot per sample) -> values and advantages through the
slots: alignment, reward placement, token budget, no record changed after construction."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sao_megatron.core.records import Sample, SampleStatus, action_counts
from sao_megatron.trainer.batching import (advantage_batch, gather_responses, pack_samples, plan_micro_batches,
                                           with_advantages, with_counts)


def _sample(uid, prompt, response, mask=None, reward=1.0, routes=True):
    n = len(response)
    total = len(prompt) + n
    return Sample(
        uid=uid, prompt_index=0, prompt_ids=list(prompt), response_ids=list(response),
        loss_mask=list(mask or [1] * n), rollout_logprobs=[-0.1 * (i + 1) for i in range(n)],
        weight_versions=[3] * n, reward=reward, status=SampleStatus.COMPLETED,
        routed_experts=torch.arange((total - 1) * 2 * 2, dtype=torch.int32).reshape(total - 1, 2, 2) if routes else None,
    )


def test_reward_sits_on_last_action_token_not_padding():
    samples = [_sample("a", [1, 2], [5, 6, 7], reward=2.0), _sample("b", [1], [5, 6, 7, 8, 9], mask=[1, 1, 0, 0, 1])]
    resp = advantage_batch(samples)
    assert resp.token_rewards[0].tolist() == [0, 0, 2.0, 0, 0]  # padding positions 3, 4 get nothing
    assert resp.token_rewards[1].tolist() == [0, 0, 0, 0, 1.0]
    assert resp.response_lengths.tolist() == [3.0, 3.0] and resp.values is None
    # a trailing observation: the reward moves back to the last generated token
    tail = advantage_batch([_sample("c", [1], [5, 6, 7], mask=[1, 1, 0], reward=1.0)])
    assert tail.token_rewards[0].tolist() == [0, 1.0, 0]


def test_train_batch_alignment():
    samples = [_sample("a", [1, 2], [5, 6, 7]), _sample("b", [1, 2, 3, 4], [8])]
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    packed = pack_samples(samples, token_budget=1000)
    batches = with_advantages(packed, adv, adv * 10, None)
    assert len(batches) == 1 and batches[0].old_values is None
    b = batches[0]
    row_a = b.sample_uids.index("a")
    row_b = b.sample_uids.index("b")
    assert b.tokens[row_a, :5].tolist() == [1, 2, 5, 6, 7]
    assert b.loss_mask[row_a].tolist() == [0, 0, 1, 1, 1]
    assert b.advantages[row_a].tolist() == [0, 0, 1, 2, 3]
    assert b.returns[row_b].tolist() == [0, 0, 0, 0, 40]
    assert torch.allclose(b.rollout_logprobs[row_a], torch.tensor([0, 0, -0.1, -0.2, -0.3]))
    assert b.weight_versions[row_a].tolist() == [-1, -1, 3, 3, 3]
    assert b.global_num_tokens == 4.0 and b.global_num_seqs == 2.0
    # routes of positions 0..T-2 copied, last position left at -1
    assert torch.equal(b.routed_experts[row_a, :4], samples[0].routed_experts)
    assert (b.routed_experts[row_a, 4] == -1).all()
    assert gather_responses(packed, [b.advantages]).tolist() == [[1, 2, 3], [4, 0, 0]]
    assert packed.batches[0].advantages.abs().sum() == 0    # the packed batch itself is left as it was


def test_micro_batches_respect_token_budget_and_keep_every_sample():
    lengths = [3, 9, 4, 12, 5, 7, 2, 8]
    samples = [_sample(str(i), [1], [2] * (n - 1), routes=False) for i, n in enumerate(lengths)]
    groups = plan_micro_batches(samples, token_budget=20)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        padded = max(samples[i].num_tokens for i in group) * len(group)
        assert padded <= 20 or len(group) == 1
    packed = pack_samples(samples, token_budget=20)
    assert [[packed.slots[i].batch for i in g] for g in groups] == [[b] * len(g) for b, g in enumerate(groups)]
    batches = packed.batches
    assert all(b.global_num_tokens == sum(n - 1 for n in lengths) for b in batches)
    assert sum(b.num_rows for b in batches) == 8
    assert all(b.routed_experts is None for b in batches)


@pytest.mark.parametrize("budget", [1000, 12])
def test_mini_batches_split_the_samples_before_packing(budget):
    """algorithm.mini_batches = 3 over 8 samples: groups of 2 / 3 / 3 samples in order, whether the batch
    fits one micro-batch (budget 1000) or needs several (12); no micro-batch straddles two groups."""
    from sao_megatron.trainer.batching import mini_batch_ranges

    samples = [_sample(str(i), [1], [2] * (i % 3 + 2), routes=False) for i in range(8)]
    assert mini_batch_ranges(8, 3) == [range(0, 2), range(2, 5), range(5, 8)]
    assert mini_batch_ranges(2, 4) == [range(0, 1), range(1, 2)] and mini_batch_ranges(5, 1) == [range(0, 5)]
    packed = pack_samples(samples, token_budget=budget, mini_batches=3)
    parts = {}
    for i, slot in enumerate(packed.slots):
        batch = packed.batches[slot.batch]
        assert batch.sample_uids[slot.row] == str(i)       # the slot points at the sample's own row
        parts.setdefault(batch.mini_batch, set()).add(i)
    assert parts == {0: {0, 1}, 1: {2, 3, 4}, 2: {5, 6, 7}}
    assert len(packed.batches) == (3 if budget == 1000 else len(packed.batches)) and len(packed.batches) >= 3
    assert all(b.global_num_tokens == sum(len(x.response_ids) for x in samples) for b in packed.batches)
    assert {b.mini_batch for b in pack_samples(samples, token_budget=budget).batches} == {0}


def test_data_parallel_shards_cover_every_row_once():
    from sao_megatron.trainer.batching import shard_for_data_parallel

    samples = [_sample(str(i), [1], [2] * 3, routes=False) for i in range(5)]
    batches = pack_samples(samples, token_budget=1000).batches
    assert len(batches) == 1  # everything fits one micro-batch: DP must split it by rows
    shards = [shard_for_data_parallel(batches, rank, 2) for rank in range(2)]
    uids = [uid for shard in shards for b in shard for uid in b.sample_uids]
    assert sorted(uids) == sorted(s.uid for s in samples)
    assert all(b.global_num_tokens == 15.0 for shard in shards for b in shard)
    assert all(b.tokens.shape[0] == len(b.sample_uids) == b.advantages.shape[0] for shard in shards for b in shard)
    with pytest.raises(ValueError, match="rollout.batch_size"):
        shard_for_data_parallel(pack_samples(samples[:1], 1000).batches, 0, 2)


def test_values_and_advantages_meet_each_sample_through_its_slot():
    """Samples spread over several micro-batches in planner order (longest first): a critic value
    written at a sample's sequence positions comes back on that sample's response-space row, and
    advantages and old values go back to the same positions, in new batches."""
    samples = [_sample("short", [1], [5]), _sample("long", [1, 2, 3], [5, 6, 7]), _sample("mid", [1, 2], [5, 6])]
    packed = pack_samples(samples, token_budget=6)
    assert len(packed.batches) == 3 and [s.batch for s in packed.slots] == [2, 0, 1]
    # a fake critic: value = 10 * sample number + sequence position, everywhere in each row
    per_batch = [torch.zeros(b.tokens.shape) for b in packed.batches]
    for number, slot in enumerate(packed.slots):
        per_batch[slot.batch][slot.row] = 10 * number + torch.arange(per_batch[slot.batch].shape[1])
    values = gather_responses(packed, per_batch)
    assert values.tolist() == [[1, 0, 0], [13, 14, 15], [22, 23, 0]]
    inputs = advantage_batch(samples, values)
    adv = torch.tensor([[1.0, 0, 0], [2.0, 3.0, 4.0], [5.0, 6.0, 0]])
    batches = with_advantages(packed, adv, None, inputs.values)
    long_row = batches[0]
    assert long_row.sample_uids == ["long"] and long_row.advantages[0].tolist() == [0, 0, 0, 2, 3, 4]
    assert long_row.old_values[0].tolist() == [0, 0, 0, 13, 14, 15] and long_row.returns.abs().sum() == 0
    assert batches[1].old_values[0].tolist() == [0, 0, 22, 23]
    with pytest.raises(dataclasses.FrozenInstanceError):
        long_row.advantages = adv


def test_one_count_for_the_loss_denominators():
    """action_counts is what pack_samples and each mini-batch (with_counts) use: tokens with loss and
    sequences with any, so an observation-only sample counts no sequence."""
    samples = [_sample("a", [1], [5, 6, 7], mask=[1, 0, 1]), _sample("b", [1], [5, 6], mask=[0, 0]),
               _sample("c", [1, 2], [5])]
    batches = pack_samples(samples, token_budget=4).batches
    assert action_counts(batches) == (3.0, 2.0)
    assert all((b.global_num_tokens, b.global_num_seqs) == (3.0, 2.0) for b in batches)
    part = with_counts(batches[:1])
    assert (part[0].global_num_tokens, part[0].global_num_seqs) == action_counts(batches[:1])
