"""Two-rank checks of the pieces: vocab-parallel logprobs vs full log_softmax (values and grads),
HF export round trips under TP2/EP2/PP2, and the critic (values, frozen attention) under TP2 and PP2."""
from __future__ import annotations

import pytest
import torch

from parallel.distributed import run_distributed_test

VOCAB = 101  # not a multiple of tp: exercises the padded columns


def _vocab_parallel(seed: int = 0) -> dict:
    from megatron.core import parallel_state

    from sao_megatron.core.dims import ParallelDims
    from parallel.distributed import init_model_parallel, teardown_model_parallel
    from parallel.logprobs import vocab_parallel_logprobs_entropy

    init_model_parallel(ParallelDims(tp=2), seed=seed)
    try:
        gen = torch.Generator().manual_seed(seed)
        full = torch.randn(3, 7, 128, generator=gen) * 3
        targets = torch.randint(0, VOCAB, (3, 7), generator=gen)
        rank = parallel_state.get_tensor_model_parallel_rank()
        local = full[..., rank * 64:(rank + 1) * 64].clone().requires_grad_(True)
        logp, ent = vocab_parallel_logprobs_entropy(local, targets, VOCAB)
        (logp.sum() + 0.5 * ent.sum()).backward()
        return {"logp": logp.detach(), "ent": ent.detach(), "grad": local.grad, "full": full, "targets": targets}
    finally:
        teardown_model_parallel()


def _export_and_critic(model_dir: str) -> dict:
    from dataclasses import replace

    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    hf = load_file(f"{model_dir}/model.safetensors")
    batches = lc.fixed_batches(105, num=2, seq=12)
    out = {}
    for name, layout in {"tp2": dict(tp=2), "ep2": dict(ep=2), "pp2": dict(pp=2), "vpp2": dict(pp=2, vpp=2)}.items():
        teardown_model_parallel()
        policy = RLModel.build(lc.make_recipe(model_dir, layout), "policy")
        policy.load_hf_state_dict(hf)
        exported = dict(policy.export_hf())
        out[f"export_{name}"] = set(exported) == set(hf) and all(torch.equal(exported[k], hf[k]) for k in hf)
        shares = {n: (share, torch.equal(t, hf[n])) for n, t, share in policy.export_hf(scope="shares")}
        out[f"shares_{name}"] = {n: share for n, (share, _) in shares.items()}
        out[f"shares_equal_{name}"] = all(equal for _, equal in shares.values())
    for name, layout in {"pp2": dict(pp=2), "vpp2": dict(pp=2, vpp=2)}.items():  # 3 micro-batches: VPP pads to 4
        teardown_model_parallel()
        policy = RLModel.build(lc.make_recipe(model_dir, layout), "policy")
        policy.load_hf_state_dict(hf)
        three = lc.fixed_batches(105, num=3, seq=12)
        out[f"three_{name}"] = {"logp": [lp for lp, _ in policy.compute_logprobs(three)],
                                "step": policy.train_step(three, lc.policy_gradient_loss)}
    for name, layout in {"single_world": dict(), "tp2": dict(tp=2), "pp2": dict(pp=2)}.items():
        teardown_model_parallel()
        critic = RLModel.build(lc.make_recipe(model_dir, layout), "critic")
        critic.load_hf_state_dict(hf)
        frozen = {n: p.detach().clone() for m in critic.modules for n, p in m.named_parameters() if "self_attention" in n}
        targets = [replace(b, returns=b.loss_mask * 0.5) for b in batches]
        local = lc.dp_shard(targets)
        losses = [critic.train_step(local, lc.value_loss)["value_loss"] for _ in range(3)]
        out[f"critic_{name}"] = {
            "values": critic.compute_values(batches), "losses": losses,
            "frozen_equal": all(torch.equal(frozen[n], p) for m in critic.modules for n, p in m.named_parameters() if n in frozen)}
    teardown_model_parallel()
    return out


def test_vocab_parallel_logprobs_entropy_and_grads_equal_full_softmax():
    results = run_distributed_test(_vocab_parallel, world_size=2, timeout_s=300)
    full, targets = results[0]["full"], results[0]["targets"]
    ref_in = full[..., :VOCAB].clone().requires_grad_(True)
    logsm = torch.log_softmax(ref_in, -1)
    ref_logp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = -(logsm.exp() * logsm).sum(-1)
    (ref_logp.sum() + 0.5 * ref_ent.sum()).backward()
    grad = torch.cat([results[0]["grad"], results[1]["grad"]], dim=-1)
    for r in results:
        assert torch.allclose(r["logp"], ref_logp, atol=2e-6, rtol=0)
        assert torch.allclose(r["ent"], ref_ent, atol=2e-6, rtol=0)
    assert torch.allclose(grad[..., :VOCAB], ref_in.grad, atol=2e-6, rtol=0)
    assert float(grad[..., VOCAB:].abs().max()) == 0.0  # padded columns get no gradient


@pytest.fixture(scope="module")
def components(tiny_model_dir):
    return run_distributed_test(_export_and_critic, world_size=2, timeout_s=600, args=(str(tiny_model_dir),))


@pytest.mark.parametrize("name", ["tp2", "ep2", "pp2", "vpp2"])
def test_export_hf_round_trips_on_every_rank(components, name):
    assert all(rank[f"export_{name}"] for rank in components)


@pytest.mark.parametrize("name", ["tp2", "ep2", "pp2", "vpp2"])
def test_export_shares_deal_every_tensor_among_the_ranks_that_hold_it(components, tiny_model_dir, name):
    """scope="shares" (shard writes from every rank): each rank yields the tensors its TP group gathered,
    equal to the HF ones, as holder i of n; every name is held by n ranks with indexes 0..n-1; under
    TP2 both ranks hold everything, under EP2 an expert only its EP rank, under PP2 a layer its stage."""
    from safetensors.torch import load_file

    names = set(load_file(f"{tiny_model_dir}/model.safetensors"))
    held: dict[str, list] = {}
    for rank in components:
        assert rank[f"shares_equal_{name}"]
        for n, share in rank[f"shares_{name}"].items():
            held.setdefault(n, []).append(tuple(share))
    assert set(held) == names
    for n, shares in held.items():
        assert sorted(shares) == [(i, len(shares)) for i in range(len(shares))], n
    counts = {n: len(s) for n, s in held.items()}
    expert = [n for n in names if ".mlp.experts." in n]
    if name == "tp2":
        assert set(counts.values()) == {2}
    elif name == "ep2":
        assert all(counts[n] == 1 for n in expert) and all(counts[n] == 2 for n in names - set(expert))
    else:
        assert all(counts[n] == 1 for n in names if ".layers." in n)


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_critic_matches_dp2_reference_and_keeps_attention_frozen(components, name):
    ref = components[0]["critic_single_world"]  # tp1 pp1 dp2 on the same two ranks
    for rank in components:
        got = rank[f"critic_{name}"]
        assert got["frozen_equal"]
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-6)
        assert got["losses"][-1] < got["losses"][0]
        for v, r in zip(got["values"], ref["values"]):
            assert torch.allclose(v, r, atol=2e-6, rtol=0)


def test_vpp_with_fewer_micro_batches_than_needed_matches_pp(components):
    for rank in components:
        pp, vpp = rank["three_pp2"], rank["three_vpp2"]
        assert len(vpp["logp"]) == 3
        assert all(torch.equal(a, b) for a, b in zip(pp["logp"], vpp["logp"]))
        assert vpp["step"]["loss"] == pytest.approx(pp["step"]["loss"], abs=1e-7)
        assert vpp["step"]["grad_norm"] == pytest.approx(pp["step"]["grad_norm"], rel=1e-6)
