"""Property tests (hypothesis) for the invariants every RL stack gets wrong somewhere.

- masked / padded tokens (holding garbage, even NaN and inf) never change a loss or a gradient;
- splitting a step into micro-batches with the global denominators gives the same loss and gradient;
- on-policy DIS equals the plain policy-gradient loss;
- GSPO-token equals GSPO when each sequence's advantages are uniform;
- DIS's weight carries no gradient; skip-observation GAE equals GAE on the compacted action tokens.
Data come from a seeded torch generator; hypothesis picks shapes, seeds, losses and modes.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_megatron.algorithms import (AGG_MODES, compute_gae, compute_policy_loss, dis_loss, gspo_loss,
                                     gspo_token_loss, policy_gradient_loss)
from sao_megatron.algorithms.aggregation import Aggregation
from sao_megatron.core.config import AlgorithmConfig
from sao_megatron.core.records import LossInputs

FAST = settings(max_examples=40, deadline=None, database=None)  # no example database in the shared tree
LOSSES = ("dis", "ppo", "gspo", "gspo_token", "cispo")
NORM_LEN = 16.0  # constant L for seq-mean-token-sum-norm, so shape changes do not matter


def make_batch(seed, rows, width, p_mask=0.7):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, width, generator=g) < p_mask).float()
    mask[0, 0] = 1.0                                  # at least one action token
    logp = -torch.rand(rows, width, generator=g) * 3
    return dict(logp=logp, rollout=logp + torch.randn(rows, width, generator=g) * 0.4,
                old=logp + torch.randn(rows, width, generator=g) * 0.2,
                ref=logp + torch.randn(rows, width, generator=g) * 0.3,
                adv=torch.randn(rows, width, generator=g), entropy=torch.rand(rows, width, generator=g),
                mask=mask)


def cfg(loss, agg, correction="none"):
    return AlgorithmConfig(name="sao", loss=loss, eps_low=0.2, eps_high=0.28, loss_agg=agg, kl_coef=0.05,
                           entropy_coef=0.01, correction=correction, dual_clip=3.0 if loss == "ppo" else None)


def run(c, b, logp, **global_counts):
    inputs = LossInputs(logp, b["rollout"], b["adv"], b["mask"], old_logp=b["old"], ref_logp=b["ref"],
                        entropy=b["entropy"], **global_counts)
    out = compute_policy_loss(c, inputs, norm_len=NORM_LEN)
    (grad,) = torch.autograd.grad(out.loss, logp)
    return out, grad


def garbage_like(x, seed):
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 7.0])
    return choices[torch.randint(len(choices), x.shape, generator=g)]


@FAST
@given(seed=st.integers(0, 10**6), rows=st.integers(1, 4), width=st.integers(1, 6), pad=st.integers(1, 4),
       loss=st.sampled_from(LOSSES), agg=st.sampled_from(AGG_MODES),
       correction=st.sampled_from(["none", "tis", "mis", "icepop"]))
def test_masked_and_padded_tokens_change_nothing(seed, rows, width, pad, loss, agg, correction):
    b = make_batch(seed, rows, width)
    logp = b["logp"].clone().requires_grad_(True)
    out, grad = run(cfg(loss, agg, correction), b, logp)
    # Pad every tensor with `pad` columns, then fill every mask-0 position with garbage.
    padded = {k: torch.cat([v, torch.zeros(rows, pad)], 1) for k, v in b.items()}
    off = padded["mask"] == 0
    for i, k in enumerate(("logp", "rollout", "old", "ref", "adv", "entropy")):
        padded[k] = torch.where(off, garbage_like(padded[k], seed + i), padded[k])
    logp_p = padded["logp"].clone().requires_grad_(True)
    out_p, grad_p = run(cfg(loss, agg, correction), padded, logp_p)
    assert torch.allclose(out_p.loss, out.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(grad_p[off], torch.zeros_like(grad_p[off]))
    keep = b["mask"] > 0
    assert torch.allclose(grad_p[:, :width][keep], grad[keep], rtol=1e-5, atol=1e-7)


@FAST
@given(seed=st.integers(0, 10**6), rows=st.integers(2, 6), width=st.integers(1, 6), cut=st.integers(1, 5),
       loss=st.sampled_from(LOSSES), agg=st.sampled_from(AGG_MODES),
       correction=st.sampled_from(["none", "tis", "mis"]))
def test_micro_batches_with_global_counts_give_the_full_gradient(seed, rows, width, cut, loss, agg, correction):
    b = make_batch(seed, rows, width)
    c = cfg(loss, agg, correction)
    logp = b["logp"].clone().requires_grad_(True)
    full, full_grad = run(c, b, logp)
    counts = dict(global_num_tokens=float(b["mask"].sum()), global_num_seqs=float((b["mask"].sum(-1) > 0).sum()))
    cut = min(cut, rows - 1)
    total, grads, clipfrac = 0.0, [], 0.0
    for part in (slice(0, cut), slice(cut, rows)):
        sub = {k: v[part] for k, v in b.items()}
        sub_logp = sub["logp"].clone().requires_grad_(True)
        out, grad = run(c, sub, sub_logp, **counts)
        total, clipfrac = total + out.loss.item(), clipfrac + out.metrics["pg_clipfrac"].item()
        grads.append(grad)
    assert abs(total - full.loss.item()) <= 1e-5 * max(1.0, abs(full.loss.item()))
    assert torch.allclose(torch.cat(grads), full_grad, rtol=1e-5, atol=1e-7)
    assert abs(clipfrac - full.metrics["pg_clipfrac"].item()) < 1e-6   # metrics add up the same way


@FAST
@given(seed=st.integers(0, 10**6), rows=st.integers(1, 4), width=st.integers(1, 6), agg=st.sampled_from(AGG_MODES))
def test_on_policy_dis_equals_policy_gradient(seed, rows, width, agg):
    b = make_batch(seed, rows, width)
    a = Aggregation(agg, norm_len=NORM_LEN)
    logp1 = b["logp"].clone().requires_grad_(True)
    logp2 = b["logp"].clone().requires_grad_(True)
    dis = dis_loss(logp1, b["logp"].clone(), b["adv"], b["mask"], 0.3, 5.0, agg=a)
    pg = policy_gradient_loss(logp2, b["adv"], b["mask"], agg=a)
    assert torch.allclose(dis.loss, pg.loss, rtol=1e-6, atol=1e-7)
    assert torch.allclose(torch.autograd.grad(dis.loss, logp1)[0], torch.autograd.grad(pg.loss, logp2)[0])
    assert dis.metrics["pg_clipfrac"].item() == 0.0


@FAST
@given(seed=st.integers(0, 10**6), rows=st.integers(1, 4), width=st.integers(1, 6), agg=st.sampled_from(AGG_MODES),
       eps=st.sampled_from([(3e-4, 4e-4), (0.2, 0.2), (0.1, 0.5)]))
def test_gspo_token_equals_gspo_with_uniform_advantages(seed, rows, width, agg, eps):
    b = make_batch(seed, rows, width)
    adv = torch.randn(rows, 1, generator=torch.Generator().manual_seed(seed)).expand(rows, width)
    a = Aggregation(agg, norm_len=NORM_LEN)
    logp1 = b["logp"].clone().requires_grad_(True)
    logp2 = b["logp"].clone().requires_grad_(True)
    seq = gspo_loss(logp1, b["old"], adv, b["mask"], *eps, agg=a)
    tok = gspo_token_loss(logp2, b["old"], adv, b["mask"], *eps, agg=a)
    assert torch.allclose(seq.loss, tok.loss, rtol=1e-5, atol=1e-7)
    assert torch.allclose(torch.autograd.grad(seq.loss, logp1)[0], torch.autograd.grad(tok.loss, logp2)[0],
                          rtol=1e-5, atol=1e-7)


@FAST
@given(seed=st.integers(0, 10**6), rows=st.integers(1, 4), width=st.integers(1, 6))
def test_dis_weight_carries_no_gradient(seed, rows, width):
    # d loss / d logp_t must be exactly -w_t A_t / N with w_t = r_t 1[band] held constant. Were the weight
    # differentiated, d(r logp)/dlogp = r logp + r would add -r A logp / N.
    b = make_batch(seed, rows, width)
    logp = b["logp"].clone().requires_grad_(True)
    out = dis_loss(logp, b["rollout"], b["adv"], b["mask"], 0.3, 5.0)
    (grad,) = torch.autograd.grad(out.loss, logp)
    ratio = torch.exp(b["logp"] - b["rollout"])
    keep = (b["mask"] > 0) & (ratio > 0.7) & (ratio < 6.0)
    expected = torch.where(keep, -ratio * b["adv"], torch.zeros(())) / b["mask"].sum()
    assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-7)


@FAST
@given(seed=st.integers(0, 10**6), width=st.integers(1, 12), gamma=st.floats(0.5, 1.0), lam=st.floats(0.0, 1.0))
def test_skip_observation_gae_equals_gae_on_compacted_actions(seed, width, gamma, lam):
    b = make_batch(seed, 1, width, p_mask=0.6)
    g = torch.Generator().manual_seed(seed + 1)
    r, v = torch.randn(1, width, generator=g), torch.randn(1, width, generator=g)
    adv, ret = compute_gae(r, v, b["mask"], gamma, lam)
    idx = torch.nonzero(b["mask"][0]).squeeze(-1)
    adv_c, ret_c = compute_gae(r[:, idx], v[:, idx], torch.ones(1, len(idx)), gamma, lam)
    assert torch.allclose(adv[:, idx], adv_c, atol=1e-6) and torch.allclose(ret[:, idx], ret_c, atol=1e-6)
    assert torch.count_nonzero(adv[b["mask"] == 0]) == 0
