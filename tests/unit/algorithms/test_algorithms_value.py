"""Value loss and explained variance: hand vectors, clipping, micro-batch combination, batch size 1."""
import math

import pytest
import torch

from sao_megatron.algorithms import combine_metrics, compute_value_loss, explained_variance

T = torch.tensor

# One row (batch size 1) of 3 action tokens and a padded 4th: V = [.5, 1.5, 2, 9], R = [1, 1, 3, 7].
VALUES, RETURNS, MASK = T([[0.5, 1.5, 2.0, 9.0]]), T([[1.0, 1.0, 3.0, 7.0]]), T([[1.0, 1.0, 1.0, 0.0]])


def test_masked_mse_vector():
    # errors (V - R)^2 = [.25, .25, 1]; loss = 1.5/3 = .5; grad 2(V - R)/3 = [-1/3, 1/3, -2/3, 0]
    v = VALUES.clone().requires_grad_(True)
    out = compute_value_loss(v, RETURNS, MASK)
    assert out.loss.item() == pytest.approx(0.5)
    (g,) = torch.autograd.grad(out.loss, v)
    assert torch.allclose(g, T([[-1 / 3, 1 / 3, -2 / 3, 0.0]]))
    m = out.metrics
    assert m["vf_loss"].item() == pytest.approx(0.5)
    assert m["value_mean"].item() == pytest.approx(4 / 3) and m["return_mean"].item() == pytest.approx(5 / 3)
    assert m["vf_clipfrac"].item() == 0.0


def test_explained_variance_batch_size_one_is_not_zero():
    # Known bug 8. Over tokens: R = [1, 1, 3]: mean 5/3, Var = (2*(2/3)^2 + (4/3)^2)/3 = 24/27 = .888889
    # resid R - V = [.5, -.5, 1]: mean 1/3, Var = ((1/6)^2 + (5/6)^2 + (2/3)^2)/3 = (42/36)/3 = .388889
    # EV = 1 - .388889/.888889 = 1 - .4375 = .5625
    out = compute_value_loss(VALUES, RETURNS, MASK)
    assert out.metrics["vf_explained_var"].item() == pytest.approx(0.5625)
    assert explained_variance(VALUES, RETURNS, MASK).item() == pytest.approx(0.5625)


def test_explained_variance_undefined_when_returns_are_constant():
    ev = explained_variance(T([[0.1, 0.2]]), T([[1.0, 1.0]]), T([[1.0, 1.0]]))
    assert math.isnan(ev.item())


def test_value_clipping_vector():
    # old V = [1, 1, 1], clip .2: clipped V = 1 + clamp(V - 1, -.2, .2) = [.8, 1.2, 1.2]
    # clipped errors [(.8-1)^2, (1.2-1)^2, (1.2-3)^2] = [.04, .04, 3.24]; unclipped [.25, .25, 1]
    # max = [.25, .25, 3.24] -> loss 3.74/3 = 1.246667; token 2 takes the clipped branch (clamped: no grad)
    v = VALUES.clone().requires_grad_(True)
    out = compute_value_loss(v, RETURNS, MASK, old_values=T([[1.0, 1.0, 1.0, 0.0]]), value_clip=0.2)
    assert out.loss.item() == pytest.approx(1.246667, abs=1e-6)
    (g,) = torch.autograd.grad(out.loss, v)
    assert torch.allclose(g, T([[-1 / 3, 1 / 3, 0.0, 0.0]]))
    assert out.metrics["vf_clipfrac"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="value_clip"):
        compute_value_loss(v, RETURNS, MASK, value_clip=0.2)


def test_micro_batches_combine_to_the_full_batch():
    # Split the 3 tokens over two micro-batches with the global count 3: losses add to .5, and the
    # explained variance recomputed from the summed moments equals the full batch's .5625, although the
    # first micro-batch alone (R = [1, 1]) has no defined EV.
    parts = [compute_value_loss(VALUES[:, :2], RETURNS[:, :2], MASK[:, :2], global_num_tokens=3),
             compute_value_loss(VALUES[:, 2:], RETURNS[:, 2:], MASK[:, 2:], global_num_tokens=3)]
    assert sum(p.loss.item() for p in parts) == pytest.approx(0.5)
    assert math.isnan(parts[0].metrics["vf_explained_var"].item())
    combined = combine_metrics([p.metrics for p in parts])
    assert combined["vf_explained_var"] == pytest.approx(0.5625, abs=1e-6)
    assert combined["vf_loss"] == pytest.approx(0.5) and combined["value_mean"] == pytest.approx(4 / 3)
