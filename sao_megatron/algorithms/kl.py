"""KL estimators between the current policy pi_theta and a reference pi_ref, per token.

Source: J. Schulman, "Approximating KL Divergence" (2020). With samples y ~ pi_theta and
log-ratio d = log pi_ref(y) - log pi_theta(y) (so r = pi_ref / pi_theta = exp(d)):

- k1 = -d = logp - ref_logp                 unbiased for KL(pi_theta || pi_ref), high variance
- k2 = d^2 / 2                               biased, low variance
- k3 = r - 1 - log r = exp(d) - d - 1        unbiased and >= 0 (the GRPO penalty, arXiv 2402.03300 eq. 4)
- low_var_kl = min(k3, 10)                   k3 clamped to [-10, 10], as verl and slime do

Names: verl's ``kl_penalty`` and slime's ``--kl-loss-type`` use k1/"kl", k2/"mse", k3 and "low_var_kl"
(verl clamps its "k3" too; here "k3" is unclamped and "low_var_kl" is the clamped one, as in slime).

As a *reward penalty* (``kl_penalty``) any estimator is fine: it is a detached number. As a *loss term*
the estimator is differentiated, and that is where implementations go wrong (Known bug 6):
d k3/d theta = (1 - r) grad log pi, whose expectation under pi_theta is -E_{pi_ref}[grad log pi], the
gradient of the *forward* KL(pi_ref || pi_theta), not of the reverse KL that k3 estimates; d k1 has
expectation 0. Only k2's gradient, (logp - ref) grad log pi, is the score-function gradient of
KL(pi_theta || pi_ref) on-policy. ``kl_loss_term`` therefore returns the chosen estimator's *value* with
k2's *gradient* (straight-through), so the logged number and the gradient are both right.
"""
from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
ALIASES = {"kl": "k1", "mse": "k2"}   # verl's names for the same estimators


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate (formulas in the module docstring); differentiable."""
    estimator = ALIASES.get(estimator, estimator)
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        # Clamp d so exp cannot overflow on a pathological token; the clamp is far outside any real ratio.
        d = d.clamp(-20.0, 20.0)
        return torch.exp(d) - d - 1.0
    if estimator == "low_var_kl":
        return kl_estimate(logp, ref_logp, "k3").clamp(-10.0, 10.0)
    raise ValueError(f"algorithm.kl_estimator: unknown {estimator!r}; fix: use one of {', '.join(KL_ESTIMATORS)}")


def kl_loss_term(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL loss term: value of ``estimator``, gradient of k2 = (logp - ref_logp) * grad logp.

    value = k(estimator) ; grad = grad k2  (straight-through: k.detach() + k2 - k2.detach()).
    """
    value = kl_estimate(logp.detach(), ref_logp, estimator)
    k2 = kl_estimate(logp, ref_logp.detach(), "k2")
    return value + (k2 - k2.detach())


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Detached per-token KL estimate, to subtract from token rewards: r_t <- r_t - beta * k_t."""
    with torch.no_grad():
        return kl_estimate(logp, ref_logp, estimator)


def apply_kl_penalty(token_rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor,
                     mask: torch.Tensor, coef: float, estimator: str = "k3") -> torch.Tensor:
    """Token rewards with the KL penalty on action tokens: r_t - coef * k_t * m_t (InstructGPT-style,
    arXiv 2203.02155 eq. 2). Observation and padding tokens (m = 0) are left untouched."""
    keep = mask > 0
    pen = torch.where(keep, kl_penalty(logp, ref_logp, estimator), torch.zeros_like(token_rewards))
    return token_rewards - coef * pen
