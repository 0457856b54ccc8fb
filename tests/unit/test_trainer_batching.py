"""Samples -> response tensors -> packed micro-batches: alignment, reward placement, token budget."""
from __future__ import annotations

import pytest
import torch

from sao_megatron.core.records import Sample, SampleStatus
from sao_megatron.trainer.batching import (build_train_batches, plan_micro_batches, response_tensors,
                                           to_response_space)


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
    resp = response_tensors(samples)
    assert resp.token_rewards[0].tolist() == [0, 0, 2.0, 0, 0]  # padding positions 3, 4 get nothing
    assert resp.token_rewards[1].tolist() == [0, 0, 0, 0, 1.0]
    assert resp.action_lengths.tolist() == [3.0, 3.0]
    # a trailing observation: the reward moves back to the last generated token
    tail = response_tensors([_sample("c", [1], [5, 6, 7], mask=[1, 1, 0], reward=1.0)])
    assert tail.token_rewards[0].tolist() == [0, 1.0, 0]


def test_train_batch_alignment():
    samples = [_sample("a", [1, 2], [5, 6, 7]), _sample("b", [1, 2, 3, 4], [8])]
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    batches = build_train_batches(samples, adv, adv * 10, token_budget=1000)
    assert len(batches) == 1
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
    back = to_response_space(samples, [b.advantages[row_a], b.advantages[row_b]], 3)
    assert back.tolist() == [[1, 2, 3], [4, 0, 0]]


def test_micro_batches_respect_token_budget_and_keep_every_sample():
    lengths = [3, 9, 4, 12, 5, 7, 2, 8]
    samples = [_sample(str(i), [1], [2] * (n - 1), routes=False) for i, n in enumerate(lengths)]
    groups = plan_micro_batches(samples, token_budget=20)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        padded = max(samples[i].num_tokens for i in group) * len(group)
        assert padded <= 20 or len(group) == 1
    batches = build_train_batches(samples, torch.zeros(8, 12), None, token_budget=20)
    assert all(b.global_num_tokens == sum(n - 1 for n in lengths) for b in batches)
    assert sum(b.num_rows for b in batches) == 8
    assert all(b.routed_experts is None for b in batches)


def test_data_parallel_shards_cover_every_row_once():
    from sao_megatron.trainer.batching import shard_for_data_parallel

    samples = [_sample(str(i), [1], [2] * 3, routes=False) for i in range(5)]
    batches = build_train_batches(samples, torch.zeros(5, 3), None, token_budget=1000)
    assert len(batches) == 1  # everything fits one micro-batch: DP must split it by rows
    shards = [shard_for_data_parallel(batches, rank, 2) for rank in range(2)]
    uids = [uid for shard in shards for b in shard for uid in b.sample_uids]
    assert sorted(uids) == sorted(s.uid for s in samples)
    assert all(b.global_num_tokens == 15.0 for shard in shards for b in shard)
    assert all(b.tokens.shape[0] == len(b.sample_uids) == b.advantages.shape[0] for shard in shards for b in shard)
    with pytest.raises(ValueError, match="rollout.batch_size"):
        shard_for_data_parallel(build_train_batches(samples[:1], torch.zeros(1, 3), None, 1000), 0, 2)
