"""Train/inference corrections (TIS, MIS, IcePop) and KL estimators: hand vectors and a gradient check."""
import math

import pytest
import torch

from sao_megatron.algorithms import apply_kl_penalty, correction_weights, kl_estimate, kl_loss_term, kl_penalty

T = torch.tensor


def rho_logs(*rhos):
    # train logprob = ln(rho), rollout logprob = 0 -> rho_t = exp(train - rollout); exact in float32 for these.
    return T([[math.log(x) for x in rhos]], dtype=torch.float32)


RHO = (0.25, 0.5, 1.0, 2.0, 4.0)


def test_tis_truncates_at_c():
    # C = 2: w = min(rho, 2) = [.25, .5, 1, 2, 2]; mean 5.75/5 = 1.15; nothing masked
    w, m = correction_weights("tis", rho_logs(*RHO), torch.zeros(1, 5), torch.ones(1, 5), high=2.0)
    assert torch.allclose(w, T([[0.25, 0.5, 1.0, 2.0, 2.0]]))
    assert m["tis_weight_mean"].item() == pytest.approx(1.15)
    assert m["tis_maskfrac"].item() == 0.0 and m["tis_weight_max"].item() == 2.0
    # mismatch_kl = mean(rollout - train) = -(ln.25 + ln.5 + 0 + ln2 + ln4)/5 = 0
    assert m["mismatch_kl"].item() == pytest.approx(0.0, abs=1e-6)


def test_mis_token_band_is_inclusive_and_drops():
    # [0.5, 2.0]: w = rho inside (edges included), 0 outside -> [0, .5, 1, 2, 0]; 2 of 5 dropped
    w, m = correction_weights("mis", rho_logs(*RHO), torch.zeros(1, 5), torch.ones(1, 5), low=0.5, high=2.0)
    assert torch.allclose(w, T([[0.0, 0.5, 1.0, 2.0, 0.0]]))
    assert m["tis_maskfrac"].item() == pytest.approx(0.4)
    assert m["tis_weight_min"].item() == 0.0


def test_icepop_band():
    # [alpha, beta] = [0.5, 5]: [0, .5, 1, 2, 4]
    w, _ = correction_weights("icepop", rho_logs(*RHO), torch.zeros(1, 5), torch.ones(1, 5), low=0.5, high=5.0)
    assert torch.allclose(w, T([[0.0, 0.5, 1.0, 2.0, 4.0]]))


def test_sequence_level_mis_and_tis():
    # row 0: log rho = [ln2, ln.5, ln1.5] -> seq rho = 2*.5*1.5 = 1.5 (inside [.5, 2]) on all 3 tokens
    # row 1: [ln2, ln2, pad] -> seq rho 4: MIS drops the row, TIS gives min(4, 2) = 2; padding weight 0
    train = T([[math.log(2), math.log(0.5), math.log(1.5)], [math.log(2), math.log(2), 123.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, m = correction_weights("mis", train, torch.zeros(2, 3), mask, low=0.5, high=2.0, level="sequence")
    assert torch.allclose(w, T([[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]]), atol=1e-6)
    assert m["tis_maskfrac"].item() == pytest.approx(0.4)
    w, _ = correction_weights("tis", train, torch.zeros(2, 3), mask, high=2.0, level="sequence")
    assert torch.allclose(w, T([[1.5, 1.5, 1.5], [2.0, 2.0, 0.0]]), atol=1e-6)


def test_none_and_bad_names():
    w, m = correction_weights("none", rho_logs(2.0), torch.zeros(1, 1), torch.ones(1, 1))
    assert w is None and m["mismatch_kl"].item() == pytest.approx(-math.log(2), abs=1e-6)
    with pytest.raises(ValueError, match="algorithm.correction"):
        correction_weights("tiss", rho_logs(2.0), torch.zeros(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="correction_level"):
        correction_weights("mis", rho_logs(2.0), torch.zeros(1, 1), torch.ones(1, 1), level="seq")


def test_correction_weight_is_detached():
    train = rho_logs(1.0, 2.0).requires_grad_(True)
    w, _ = correction_weights("tis", train, torch.zeros(1, 2), torch.ones(1, 2), high=2.0)
    assert not w.requires_grad


def test_kl_estimator_values():
    # logp -1.0, ref -1.2: d = ref - logp = -.2. k1 = .2; k2 = .02; k3 = e^-.2 + .2 - 1 = .818731 - .8 = .018731
    # logp -2, ref -1: d = 1. k1 = -1; k2 = .5; k3 = e - 1 - 1 = .718282
    logp, ref = T([-1.0, -2.0]), T([-1.2, -1.0])
    assert torch.allclose(kl_estimate(logp, ref, "k1"), T([0.2, -1.0]))
    assert torch.allclose(kl_estimate(logp, ref, "k2"), T([0.02, 0.5]))
    assert torch.allclose(kl_estimate(logp, ref, "k3"), T([0.018731, 0.718282]), atol=1e-6)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")


def test_kl_loss_term_value_and_gradient():
    # value = k3 = .018731; gradient = d k2 / d logp = logp - ref = .2 (naive k3 gradient: 1 - e^d = .181269)
    logp = T([-1.0], requires_grad=True)
    term = kl_loss_term(logp, T([-1.2]), "k3")
    assert term.item() == pytest.approx(0.018731, abs=1e-6)
    (g,) = torch.autograd.grad(term.sum(), logp)
    assert g.item() == pytest.approx(0.2, abs=1e-6)


def test_kl_loss_term_gives_the_reverse_kl_gradient_in_expectation():
    # Known bug 6. A categorical policy over 5 actions, exact expectation over y ~ pi (weights detached):
    # E_pi[grad term(y)] must equal grad KL(pi || pi_ref). The naive k3 loss instead yields grad KL(pi_ref || pi).
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(5, generator=g, requires_grad=True)
    ref_logp = torch.log_softmax(torch.randn(5, generator=g), -1)
    logp = torch.log_softmax(theta, -1)
    p = logp.exp().detach()
    exact_reverse = torch.autograd.grad((logp.exp() * (logp - ref_logp)).sum(), theta, retain_graph=True)[0]
    exact_forward = torch.autograd.grad((ref_logp.exp() * (ref_logp - logp)).sum(), theta, retain_graph=True)[0]
    for est in ("k1", "k2", "k3"):
        ours = torch.autograd.grad((p * kl_loss_term(logp, ref_logp, est)).sum(), theta, retain_graph=True)[0]
        assert torch.allclose(ours, exact_reverse, atol=1e-6), est
    naive = torch.autograd.grad((p * kl_estimate(logp, ref_logp, "k3")).sum(), theta)[0]
    assert torch.allclose(naive, exact_forward, atol=1e-6)
    assert not torch.allclose(naive, exact_reverse, atol=1e-3)


def test_kl_penalty_on_rewards():
    # r = [0, 1, 0(pad)], k1 = logp - ref = [.5, -.25, x]; coef .1 -> [-.05, 1.025, 0]
    logp, ref = T([[-1.0, -2.0, 5.0]]), T([[-1.5, -1.75, 0.0]])
    out = apply_kl_penalty(T([[0.0, 1.0, 0.0]]), logp, ref, T([[1, 1, 0]]), 0.1, "k1")
    assert torch.allclose(out, T([[-0.05, 1.025, 0.0]]))
    assert not kl_penalty(logp.requires_grad_(True), ref).requires_grad
