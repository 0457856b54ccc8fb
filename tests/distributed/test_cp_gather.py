"""Context parallel on two gloo ranks, with a stand-in per-position model (Megatron's local attention
cannot run cp > 1; the real cp = 2 vs cp = 1 check is tests/gpu/test_te_parallel.py).

Each rank runs the trainer's own schedule (run_schedule with Megatron's forward-backward) and its own
logprob path (RLModel._token_logprobs) over CP = 2, and the results are compared with one process
computing the whole sequence: logprobs, entropy, the loss and (after the DDP-style sum over the CP
group) the gradient must all equal the cp = 1 values. The split itself is checked against
Megatron's get_batch_on_this_cp_rank.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from parallel.distributed import run_distributed_test

VOCAB, SEQ, T = 23, 13, 0.7   # 13 positions: padded to a multiple of 2*cp = 4


class StandIn(torch.nn.Module):
    """logits[p] = table[token p] + pos[position p]: per position, so only the layout can go wrong."""

    def __init__(self, max_len: int):
        from megatron.core.transformer.enums import ModelType
        from megatron.core.transformer.transformer_config import TransformerConfig

        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=gen))
        self.pos = torch.nn.Parameter(torch.randn(max_len, VOCAB, generator=gen))
        self.config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, calculate_per_token_loss=True)
        self.model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, tensor) -> None:
        pass

    def forward(self, tokens, positions, mask):
        return self.table[tokens] + self.pos[positions]


def _batches():
    from parallel import layout_check as lc

    return lc.fixed_batches(VOCAB, num=2, rows=2, seq=SEQ)


def _loss(batch, outputs):
    from parallel import layout_check as lc

    return lc.policy_gradient_loss(batch, outputs)


def _logprob_owner(cp):
    """The attributes RLModel._token_logprobs reads, without building a Megatron model."""
    return SimpleNamespace(cp=cp, temperature=T, shape=SimpleNamespace(vocab_size=VOCAB))


def _cp_rank() -> dict:
    from megatron.core.utils import get_batch_on_this_cp_rank

    from parallel.context_parallel import ContextParallel
    from sao_megatron.core.dims import ParallelDims
    from parallel.distributed import init_model_parallel, teardown_model_parallel
    from parallel.packing import pad_seq, seq_multiple
    from parallel.rl_model import RLModel, _call_loss
    from parallel.schedule import run_schedule

    init_model_parallel(ParallelDims(cp=2))
    try:
        cp = ContextParallel.from_megatron()
        batches, multiple = _batches(), seq_multiple(cp=2)
        padded = pad_seq(batches[0], multiple)
        routes = torch.arange(padded.tokens.numel() * 4).reshape(*padded.tokens.shape, 2, 2)
        theirs = get_batch_on_this_cp_rank({"tokens": padded.tokens.clone(), "loss_mask": padded.loss_mask.clone(),
                                            "routes": routes.clone()})
        layout_equal = all(torch.equal(theirs[k], cp.split(v)) for k, v in
                           (("tokens", padded.tokens), ("loss_mask", padded.loss_mask), ("routes", routes)))

        model, seen, outputs = StandIn(max_len=32), [], []
        owner = _logprob_owner(cp)

        def on_output(index, batch, local_logits):
            logp, ent = RLModel._token_logprobs(owner, batch, local_logits)
            outputs.append({"logp": logp.detach(), "entropy": ent.detach()})
            return _call_loss(_loss, batch, {"logp": logp, "entropy": ent})

        store = run_schedule([model], batches, multiple, on_output,
                             before_forward=lambda chunk, local: seen.append(local.tokens.clone()), cp=cp)
        for p in model.parameters():   # what Megatron's DDP does over the data x context parallel group
            torch.distributed.all_reduce(p.grad, group=cp.group)
        return {"rank": cp.rank, "size": cp.size, "layout_equal": layout_equal, "outputs": outputs,
                "loss": sum(m["loss"] for m in store), "grads": [p.grad for p in model.parameters()],
                "seen": seen, "expect_seen": [cp.split(pad_seq(b, multiple).tokens) for b in batches]}
    finally:
        teardown_model_parallel()


def _whole_sequence() -> dict:
    """cp = 1 in this process: the same stand-in, no Megatron groups, no padding."""
    from parallel.logprobs import token_logprobs_from_logits

    model, outputs, loss = StandIn(max_len=32), [], 0.0
    for batch in _batches():
        positions = torch.arange(SEQ).unsqueeze(0).expand_as(batch.tokens)
        logp, ent = token_logprobs_from_logits(model(batch.tokens, positions, None), batch.tokens, VOCAB, temperature=T)
        outputs.append({"logp": logp.detach(), "entropy": ent.detach()})
        step = _loss(batch, {"logp": logp, "entropy": ent}).loss
        step.backward()
        loss += float(step)
    return {"outputs": outputs, "loss": loss, "grads": [p.grad for p in model.parameters()]}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed_test(_cp_rank, world_size=2, timeout_s=300)


def test_our_split_is_megatrons_get_batch_on_this_cp_rank(ranks):
    assert [(r["rank"], r["size"]) for r in ranks] == [(0, 2), (1, 2)]
    assert all(r["layout_equal"] for r in ranks)


def test_model_sees_only_its_positions(ranks):
    for r in ranks:
        assert all(s.shape[1] == 8 and torch.equal(s, e) for s, e in zip(r["seen"], r["expect_seen"]))
    assert not torch.equal(ranks[0]["seen"][0], ranks[1]["seen"][0])


def test_logprobs_entropy_loss_and_grads_equal_whole_sequence(ranks):
    ref = _whole_sequence()
    for r in ranks:
        for ours, theirs in zip(r["outputs"], ref["outputs"]):
            assert ours["logp"].shape == (2, SEQ)
            assert torch.allclose(ours["logp"], theirs["logp"], atol=1e-6)
            assert torch.allclose(ours["entropy"], theirs["entropy"], atol=1e-6)
        assert r["loss"] == pytest.approx(ref["loss"], abs=1e-6)       # same loss, same token count
        for ours, theirs in zip(r["grads"], ref["grads"]):
            assert torch.allclose(ours, theirs, atol=1e-6)             # no double count over CP
    assert float(ref["grads"][1].abs().sum()) > 0
