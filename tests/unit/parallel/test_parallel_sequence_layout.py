"""How a micro-batch's sequence is padded and cut over ranks: the FP8 / SP / CP padding multiple,
Megatron's context-parallel chunk layout and its inverse, and the recipe checks that go with them."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel import layout_check as lc
from parallel.context_parallel import ContextParallel, local_positions, restore_order, split_for_rank
from parallel.packing import pad_seq, seq_multiple
from parallel.schedule import context_local
from sao_megatron.core.config import ConfigError, load_recipe


@pytest.mark.parametrize("kw,multiple", [
    (dict(), 1),
    (dict(tp=2), 1),                                      # TP without SP never splits the sequence
    (dict(tp=2, sequence_parallel=True), 2),
    (dict(fp8="delayed"), 16),
    (dict(tp=2, fp8="tensorwise"), 16),
    (dict(tp=2, sequence_parallel=True, fp8="delayed"), 32),   # each TP rank's slice holds 16
    (dict(fp8="mxfp8"), 32),
    (dict(cp=2), 4),                                      # 2*cp chunks
    (dict(tp=4, sequence_parallel=True, cp=2), 16),
    (dict(tp=4, sequence_parallel=True, cp=2, fp8="blockwise"), 128),   # the 750B layout under FP8
])
def test_seq_multiple(kw, multiple):
    assert seq_multiple(**kw) == multiple


def test_fp8_micro_batches_have_whole_blocks_of_tokens():
    batch = lc.fixed_batches(105, num=1, rows=3, seq=21)[0]          # 21 positions: odd, as a real batch is
    padded = pad_seq(batch, seq_multiple(fp8="delayed"))
    assert padded.tokens.shape == (3, 32) and torch.equal(padded.tokens[:, :21], batch.tokens)
    assert float(padded.loss_mask[:, 21:].abs().sum()) == 0.0         # padding carries no loss
    assert pad_seq(padded, 16) is padded                               # whole blocks already: unchanged


def test_local_positions_follow_megatrons_load_balanced_chunks():
    # 8 positions, cp = 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert local_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert local_positions(12, 2, 3).tolist() == [4, 5, 6, 7]
    every = torch.cat([local_positions(24, r, 3) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        local_positions(10, 0, 3)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_restore_order_inverts_the_split(cp):
    t = torch.arange(2 * 16 * 3).reshape(2, 16, 3)
    pieces = [split_for_rank(t, r, cp) for r in range(cp)]
    assert all(p.shape == (2, 16 // cp, 3) for p in pieces)
    assert torch.equal(restore_order(pieces), t)
    rows_first = t.transpose(0, 1)        # any sequence dimension: [seq, rows, 3]
    assert torch.equal(restore_order([split_for_rank(rows_first, r, cp, dim=0) for r in range(cp)], dim=0), rows_first)


def test_context_local_cuts_every_per_position_field():
    batch = lc.fixed_batches(105, num=1, rows=2, seq=8)[0]
    batch = replace(batch, routed_experts=torch.arange(2 * 8 * 3 * 2, dtype=torch.int32).reshape(2, 8, 3, 2))
    local = context_local(batch, ContextParallel(rank=1, size=2))
    keep = [2, 3, 4, 5]
    assert torch.equal(local.tokens, batch.tokens[:, keep]) and torch.equal(local.loss_mask, batch.loss_mask[:, keep])
    assert torch.equal(local.routed_experts, batch.routed_experts[:, keep])
    assert torch.equal(local.lengths, batch.lengths)                       # per row, not per position
    assert context_local(batch, ContextParallel()) is batch


def test_per_token_function_on_split_positions_equals_whole_sequence():
    """The stand-in for a model: any per-position function commutes with split + restore."""
    from parallel.logprobs import shift_to_tokens, tempered, token_logprobs_from_logits, vocab_parallel_logprobs_entropy

    gen = torch.Generator().manual_seed(0)
    table = torch.randn(17, 17, generator=gen)
    tokens = torch.randint(0, 17, (2, 12), generator=gen)
    whole = token_logprobs_from_logits(table[tokens], tokens, 17, temperature=0.8)
    next_tokens = torch.cat([tokens[:, 1:], tokens.new_zeros(2, 1)], dim=1)
    for cp in (2, 3):
        pieces = [vocab_parallel_logprobs_entropy(tempered(table[split_for_rank(tokens, r, cp)], 0.8),
                                                  split_for_rank(next_tokens, r, cp), 17) for r in range(cp)]
        logp = shift_to_tokens(restore_order([p[0] for p in pieces]))
        assert torch.allclose(logp, whole[0], atol=1e-6)


def _recipe(*overrides: str):
    return load_recipe(None, ["model.path=unused", "parallel.cp=2", "parallel.world_size=2",
                                "parallel.pack_sequences=false", *overrides],
                       check_files=False)


def test_recipe_refuses_context_parallel_on_local_layers():
    with pytest.raises(ConfigError) as info:
        _recipe("model.transformer_impl=local")
    assert info.value.field == "parallel.cp" and "Transformer Engine" in str(info.value)
    assert "fix:" in str(info.value) and "\n" not in str(info.value)
    assert _recipe().parallel.cp == 2     # auto: TE where CUDA and TE exist; RLModel.build refuses it on CPU


def test_rl_model_refuses_context_parallel_without_cuda():
    from parallel.rl_model import _refuse_gpu_only_options

    if torch.cuda.is_available():
        pytest.skip("the refusal is for CPU-only machines")
    with pytest.raises(ValueError, match=r"parallel.cp = 2 needs CUDA and Transformer Engine.*fix: set parallel.cp = 1"):
        _refuse_gpu_only_options(_recipe())
