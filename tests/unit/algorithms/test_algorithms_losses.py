"""Hand-computed vectors for the policy losses. Arithmetic is in the comments; ln values to 6 digits:
ln 0.5 = -0.693147, ln 0.7 = -0.356675, ln 1.5 = 0.405465, ln 2 = 0.693147, ln 3 = 1.098612, ln 6 = 1.791759.
Ratios are built as exp(ln r) with the behaviour logprob 0, and every r used here is exact in float32
(checked), so the strict band edges 0.7 and 6.0 are hit exactly.
"""
import math

import pytest
import torch

from sao_megatron.algorithms import (Aggregation, cispo_loss, dis_loss, gspo_loss, gspo_token_loss,
                                     policy_gradient_loss, ppo_clip_loss)


def logs(*ratios):
    return torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float32)


def leaf(x):
    return x.clone().requires_grad_(True)


def grad_of(out, x):
    (g,) = torch.autograd.grad(out.loss, x)
    return g


def test_dis_strict_band_weights_and_loss():
    # Reasoning band eps (0.3, 5.0): kept iff 0.7 < r < 6.0 (strict).
    # r = [0.5, 0.7, 1.0, 3.0, 6.0] -> w = [0, 0 (edge), 1, 3, 0 (edge)], A = [1, -2, 0.5, -1, 2].
    # per-token -w*A*logp: t2: -1*0.5*ln1 = 0;  t3: -3*(-1)*ln3 = 3.295837;  others 0.  token-mean /5 = 0.659167
    # grad = -w*A/N: t2: -1*0.5/5 = -0.1;  t3: -3*(-1)/5 = 0.6;  others 0.
    logp = leaf(logs(0.5, 0.7, 1.0, 3.0, 6.0))
    adv = torch.tensor([[1.0, -2.0, 0.5, -1.0, 2.0]])
    out = dis_loss(logp, torch.zeros(1, 5), adv, torch.ones(1, 5), 0.3, 5.0)
    assert out.loss.item() == pytest.approx(0.659167, abs=1e-6)
    assert torch.allclose(grad_of(out, logp), torch.tensor([[0.0, 0.0, -0.1, 0.6, 0.0]]), atol=1e-7)
    m = out.metrics
    assert m["pg_clipfrac_low"].item() == pytest.approx(0.4)    # 0.5 and 0.7 masked below
    assert m["pg_clipfrac_high"].item() == pytest.approx(0.2)   # 6.0 masked above
    assert m["pg_clipfrac"].item() == pytest.approx(0.6)
    assert m["ratio_mean"].item() == pytest.approx(11.2 / 5)   # (0.5+0.7+1+3+6)/5
    assert m["ratio_max"].item() == pytest.approx(6.0) and m["ratio_min"].item() == pytest.approx(0.5)
    # ppo_kl = mean(rollout - logp) = -(ln.5 + ln.7 + 0 + ln3 + ln6)/5 = -1.840549/5 = -0.368110
    assert m["ppo_kl"].item() == pytest.approx(-0.368110, abs=1e-6)


def test_dis_masks_out_of_band_tokens_whatever_the_advantage_sign():
    # Notes vector: r = [0.7, 0.8, 2.0, 6.0], A = 1 -> w = [0, 0.8, 2.0, 0]; grad = -w/4 = [0, -0.2, -0.5, 0].
    logp = leaf(logs(0.7, 0.8, 2.0, 6.0))
    out = dis_loss(logp, torch.zeros(1, 4), torch.ones(1, 4), torch.ones(1, 4), 0.3, 5.0)
    assert torch.allclose(grad_of(out, logp), torch.tensor([[0.0, -0.2, -0.5, 0.0]]), atol=1e-7)
    # Same ratios with A = -1: PPO would keep r = 0.7 (its clip only binds on one side); DIS masks it too.
    logp = leaf(logs(0.7, 0.8, 2.0, 6.0))
    out = dis_loss(logp, torch.zeros(1, 4), -torch.ones(1, 4), torch.ones(1, 4), 0.3, 5.0)
    assert torch.allclose(grad_of(out, logp), torch.tensor([[0.0, 0.2, 0.5, 0.0]]), atol=1e-7)


def test_dis_coding_band_and_kept_normaliser():
    # Coding band eps (0.8, 3.0): kept iff 0.2 < r < 4.0. r = [0.5, 4.0, 3.0, 0.125], A = 1.
    # w = [0.5, 0, 3.0, 0]; loss terms -w*logp = [-0.5*ln.5, 0, -3*ln3, 0] = [0.346574, 0, -3.295837, 0]
    # 'all': sum/4 = -2.949263/4 = -0.737316;  grad -w/4 = [-0.125, 0, -0.75, 0]
    # 'kept': sum/2 = -1.474632;               grad -w/2 = [-0.25, 0, -1.5, 0]
    for over, expected, grad in (("all", -0.737316, [-0.125, 0.0, -0.75, 0.0]),
                                 ("kept", -1.474632, [-0.25, 0.0, -1.5, 0.0])):
        logp = leaf(logs(0.5, 4.0, 3.0, 0.125))
        out = dis_loss(logp, torch.zeros(1, 4), torch.ones(1, 4), torch.ones(1, 4), 0.8, 3.0, normalize_over=over)
        assert out.loss.item() == pytest.approx(expected, abs=1e-6)
        assert torch.allclose(grad_of(out, logp), torch.tensor([grad]), atol=1e-7)


def test_dis_token_weight_multiplies_and_carries_no_gradient():
    # r = [1, 2] (inside the band), A = 1, token_weight = [0.5, 3]: grad = -w*r*A/2 = [-0.25, -3.0]
    logp = leaf(logs(1.0, 2.0))
    tw = torch.tensor([[0.5, 3.0]], requires_grad=True)
    out = dis_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.3, 5.0, token_weight=tw)
    g_logp, g_w = torch.autograd.grad(out.loss, (logp, tw), allow_unused=True)
    assert torch.allclose(g_logp, torch.tensor([[-0.25, -3.0]]))
    assert g_w is None or torch.count_nonzero(g_w) == 0


def test_ppo_clip_higher_vector():
    # eps (0.2, 0.28): clip range [0.8, 1.28]. Per token l = max(-A r, -A clip(r)):
    # 1. r=1.5, A=+1: max(-1.5, -1.28) = -1.28  clipped (high), grad 0
    # 2. r=0.5, A=+1: max(-0.5, -0.8)  = -0.5   unclipped, grad -A r = -0.5
    # 3. r=0.5, A=-1: max(0.5, 0.8)    = 0.8    clipped (low), grad 0
    # 4. r=1.5, A=-1: max(1.5, 1.28)   = 1.5    unclipped, grad 1.5
    # 5. r=1.0, A=+2: max(-2, -2)      = -2     not clipped (tie), grad -2
    # sum = -1.28 - 0.5 + 0.8 + 1.5 - 2 = -1.48 -> /5 = -0.296; grads /5 = [0, -0.1, 0, 0.3, -0.4]
    logp = leaf(logs(1.5, 0.5, 0.5, 1.5, 1.0))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0]])
    out = ppo_clip_loss(logp, torch.zeros(1, 5), adv, torch.ones(1, 5), 0.2, 0.28)
    assert out.loss.item() == pytest.approx(-0.296, abs=1e-6)
    assert torch.allclose(grad_of(out, logp), torch.tensor([[0.0, -0.1, 0.0, 0.3, -0.4]]), atol=1e-6)
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(0.4)
    assert out.metrics["pg_clipfrac_low"].item() == pytest.approx(0.2)
    assert out.metrics["pg_clipfrac_high"].item() == pytest.approx(0.2)


def test_ppo_dual_clip_vector():
    # eps 0.2/0.2, c = 3, A = -1: r=4: max(4, 1.2) = 4 -> min(4, 3) = 3 (dual bound, grad 0)
    #                             r=2: max(2, 1.2) = 2 < 3 -> 2, grad -A r = 2
    # loss = (3 + 2)/2 = 2.5; grad = [0, 1.0]; dual fraction 1/2
    logp = leaf(logs(4.0, 2.0))
    out = ppo_clip_loss(logp, torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2, dual_clip=3.0)
    assert out.loss.item() == pytest.approx(2.5, abs=1e-6)
    assert torch.allclose(grad_of(out, logp), torch.tensor([[0.0, 1.0]]), atol=1e-6)
    assert out.metrics["pg_clipfrac_dual"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2, dual_clip=0.5)


def _gspo_batch():
    # row 0: log-ratios [0.1, -0.2, 0.4] (mean 0.1 -> s0 = e^0.1 = 1.105171), A = +1
    # row 1: log-ratios [0.3, 0.3, pad]   (mean 0.3 -> s1 = e^0.3 = 1.349859), A = -1
    logp = torch.tensor([[0.1, -0.2, 0.4], [0.3, 0.3, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    return logp, mask, adv


def test_gspo_sequence_ratio_vector():
    # eps 0.2/0.2: l0 = max(-1.105171, -1.2) = -1.105171 (unclipped)
    #              l1 = max(+1.349859, +1.2) = +1.349859 (A < 0, s > 1.2: pessimistic side, unclipped)
    # seq-mean-token-mean: (l0 + l1)/2 = 0.244688/2 = 0.122344
    # grad: row 0 token: d/dlogp (-A s0)/2 with ds0 = s0/3  -> -1.105171/6 = -0.184195
    #       row 1 token: (+s1/2)/2 = 1.349859/4 = 0.337465
    logp, mask, adv = _gspo_batch()
    logp = leaf(logp)
    out = gspo_loss(logp, torch.zeros(2, 3), adv, mask, 0.2, 0.2, agg=Aggregation("seq-mean-token-mean"))
    assert out.loss.item() == pytest.approx(0.122344, abs=1e-6)
    expected = torch.tensor([[-0.184195] * 3, [0.337465, 0.337465, 0.0]])
    assert torch.allclose(grad_of(out, logp), expected, atol=1e-6)
    # token-mean weighs sequences by length: (3*l0 + 2*l1)/5 = (-3.315513 + 2.699718)/5 = -0.123159
    out = gspo_loss(logp, torch.zeros(2, 3), adv, mask, 0.2, 0.2)
    assert out.loss.item() == pytest.approx(-0.123159, abs=1e-6)


def test_gspo_paper_range_clips_the_whole_sequence():
    # eps 3e-4/4e-4: s0 = 1.105171 > 1.0004 with A = +1 -> clipped, l0 = -1.0004, no gradient.
    logp, mask, adv = _gspo_batch()
    logp = leaf(logp[:1])
    out = gspo_loss(logp, torch.zeros(1, 3), adv[:1], mask[:1], 3e-4, 4e-4)
    assert out.loss.item() == pytest.approx(-1.0004, abs=1e-6)
    assert torch.count_nonzero(grad_of(out, logp)) == 0
    assert out.metrics["pg_clipfrac_high"].item() == pytest.approx(1.0)
    assert out.metrics["ratio_mean"].item() == pytest.approx(math.exp(0.1), abs=1e-6)


def test_gspo_token_vector():
    # row 0: s = 1.105171 for every token, A = [1, 2, -1], eps 0.2/0.2 (band [0.8, 1.2], s inside):
    #   l = -A*s = [-1.105171, -2.210342, 1.105171]; grad = -A*s/N
    # row 1: s = 1.349859, A = [1, -1]: t0 max(-1.349859, -1.2) = -1.2 (clipped, grad 0); t1 = 1.349859, grad s
    # token-mean over 5 tokens: sum = -2.210342 - 1.2 + 1.349859 = -2.060483 -> -0.412097
    logp = leaf(torch.tensor([[0.1, -0.2, 0.4], [0.3, 0.3, 0.0]]))
    adv = torch.tensor([[1.0, 2.0, -1.0], [1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = gspo_token_loss(logp, torch.zeros(2, 3), adv, mask, 0.2, 0.2)
    assert out.loss.item() == pytest.approx(-0.412097, abs=1e-6)
    s0, s1 = math.exp(0.1), math.exp(0.3)
    expected = torch.tensor([[-s0 / 5, -2 * s0 / 5, s0 / 5], [0.0, s1 / 5, 0.0]])
    assert torch.allclose(grad_of(out, logp), expected, atol=1e-6)
    assert out.metrics["pg_clipfrac_high"].item() == pytest.approx(0.2)


def test_cispo_vector():
    # eps_low 1.0 (no lower clip), eps_high 0.28: w = clip(r, 0, 1.28); r = [2, 0.5], A = 1
    # w = [1.28, 0.5]; l = -w*logp = [-1.28*0.693147, 0.5*0.693147] = [-0.887228, 0.346574]; mean -0.270327
    # grad = -w*A/2 = [-0.64, -0.25] (the clipped token keeps its gradient, unlike PPO)
    logp = leaf(logs(2.0, 0.5))
    out = cispo_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 1.0, 0.28)
    assert out.loss.item() == pytest.approx(-0.270327, abs=1e-6)
    assert torch.allclose(grad_of(out, logp), torch.tensor([[-0.64, -0.25]]), atol=1e-6)
    assert out.metrics["pg_clipfrac_high"].item() == pytest.approx(0.5)


def test_policy_gradient_loss_vector():
    # l = -A*logp: [-(2)(-1), -(-1)(-3)] = [2, -3]; mean -0.5; grad -A/2 = [-1, 0.5]
    logp = leaf(torch.tensor([[-1.0, -3.0]]))
    out = policy_gradient_loss(logp, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    assert out.loss.item() == pytest.approx(-0.5)
    assert torch.allclose(grad_of(out, logp), torch.tensor([[-1.0, 0.5]]))


@pytest.mark.parametrize("fn", [dis_loss, ppo_clip_loss, gspo_loss, gspo_token_loss, cispo_loss])
def test_eps_high_never_defaults_to_eps_low(fn):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="eps_high"):
        fn(x, x, x, torch.ones(1, 2), 0.2, None)
    with pytest.raises(ValueError, match="eps_low"):
        fn(x, x, x, torch.ones(1, 2), 0.0, 0.2)


def test_metrics_are_detached_scalars():
    logp = leaf(logs(0.5, 1.0, 2.0))
    for fn in (dis_loss, ppo_clip_loss, gspo_loss, gspo_token_loss, cispo_loss):
        out = fn(logp, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3), 0.3, 0.3)
        assert out.loss.dim() == 0 and out.loss.requires_grad
        for key, value in out.metrics.items():
            assert isinstance(value, float) or (value.dim() == 0 and not value.requires_grad), (fn, key)
