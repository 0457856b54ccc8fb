"""Packed micro-batches: the layout (parallel/packing.py PackedLayout), the token budget over real tokens
(trainer/batching.py), perf/pad_fraction, and the one-line refusals. Numerics vs the padded path are in
tests/distributed/test_packed_sequences.py."""
from __future__ import annotations

import random

import pytest
import torch

from parallel.packing import PackedLayout
from sao_megatron.core.records import Sample, TrainBatch
from sao_megatron.trainer.batching import pack_samples
from sao_megatron.trainer.speed import pad_fraction


def _batch(lengths: list[int], seq: int, layers: int = 2, k: int = 2) -> TrainBatch:
    rows = len(lengths)
    pos = torch.arange(seq).unsqueeze(0)
    real = pos < torch.tensor(lengths).unsqueeze(1)
    tokens = torch.where(real, torch.arange(1, rows * seq + 1).view(rows, seq), 0)
    routes = torch.where(real[..., None, None], tokens[..., None, None].int().expand(rows, seq, layers, k), -1)
    indexer = torch.where(real[..., None, None], pos[..., None, None].int().expand(rows, seq, layers, k), -1)
    zeros = torch.zeros(rows, seq)
    return TrainBatch(tokens=tokens, lengths=torch.tensor(lengths), loss_mask=real.float(), rollout_logprobs=zeros,
                      advantages=zeros, returns=zeros, weight_versions=torch.zeros(rows, seq, dtype=torch.long),
                      routed_experts=routes.contiguous(), indexer_topk=indexer.contiguous(), packed=True)


def test_layout_packs_rows_back_to_back_and_unpacks_them():
    batch = _batch([3, 5, 2], seq=6)
    layout = PackedLayout.of(batch, seq_multiple=4)
    assert (layout.starts, layout.real, layout.width, layout.segments()) == ([0, 3, 8], 10, 12, [3, 5, 2, 2])
    packed = layout.pack_batch(batch)
    assert packed.tokens.tolist() == [[1, 2, 3, 7, 8, 9, 10, 11, 13, 14, 0, 0]]
    assert packed.routed_experts[0, :, 0, 0].tolist() == [1, 2, 3, 7, 8, 9, 10, 11, 13, 14, -1, -1]
    # indexer selections are key positions in the sample: moved by its start in the packed row
    assert packed.indexer_topk[0, :, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1, -1]
    assert layout.positions().tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1]]
    back = layout.unpack(packed.tokens, 6, first_zero=True)
    assert back.tolist() == [[0, 2, 3, 0, 0, 0], [0, 8, 9, 10, 11, 0], [0, 14, 0, 0, 0, 0]]


def test_mask_is_block_diagonal_causal_and_cu_seqlens_match():
    layout = PackedLayout([2, 3], seq_multiple=6)
    keep = ~layout.attention_mask()[0, 0]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for a, b in ((0, 2), (2, 5), (5, 6)):
        expected[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(keep, expected)
    params = layout.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 2, 5, 6]
    assert params.max_seqlen_q == 3 and params.cu_seqlens_q.dtype == torch.int32


def _long_tailed(n: int, seed: int = 0) -> list[Sample]:
    """Response lengths with a long tail (most short, a few near the maximum), as RL rollouts are."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        length = min(int(rng.paretovariate(1.2) * 40), 2000)
        samples.append(Sample(uid=f"s{i}", prompt_index=i, prompt_ids=[1] * 16, response_ids=[2] * length,
                              loss_mask=[1] * length, rollout_logprobs=[0.0] * length, weight_versions=[0] * length))
    return samples


def test_budget_counts_real_tokens_and_pad_fraction_drops():
    samples = _long_tailed(64)
    padded = pack_samples(samples, 4096, with_routes=False)
    packed = pack_samples(samples, 4096, with_routes=False, packed=True)
    assert all(b.packed for b in packed.batches) and not any(b.packed for b in padded.batches)
    longest = max(s.num_tokens for s in samples)
    assert all(int(b.lengths.sum()) <= max(4096, longest) for b in packed.batches)
    assert len(packed.batches) < len(padded.batches)
    assert pad_fraction(packed.batches) <= 0.05 < pad_fraction(padded.batches)
    # every sample's slot still points at its own tokens
    for sample, slot in zip(samples, packed.slots):
        assert int(packed.batches[slot.batch].lengths[slot.row]) == sample.num_tokens


def test_packing_with_context_parallel_is_refused_in_one_line():
    from sao_megatron.core.config import ConfigError, load_recipe

    with pytest.raises(ConfigError) as info:
        load_recipe(None, ["model.path=unused", "parallel.cp=2", "parallel.world_size=2"], check_files=False)
    assert info.value.field == "parallel.pack_sequences" and "fix:" in str(info.value) and "\n" not in str(info.value)
    ok = load_recipe(None, ["model.path=unused", "parallel.cp=2", "parallel.world_size=2",
                            "parallel.pack_sequences=false"], check_files=False)
    assert not ok.parallel.pack_sequences
