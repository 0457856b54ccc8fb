"""Advantage estimators: skip-observation GAE with decoupled lambda (SAO), and the group baselines.

Shapes: token tensors are ``[B, T]`` over response positions with ``mask`` 1 on action tokens and 0 on
observation tokens (tool output) and padding; sequence tensors are ``[B]``. The scalar reward of a
sample sits on its *last action token* (``place_scalar_reward``), never on padding after EOS (Known
bug 4). Everything here is computed without gradient.
"""
from __future__ import annotations

from typing import Union

import torch


def place_scalar_reward(seq_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` token rewards with r_i on the last action token of row i (rows without one get none)."""
    keep = mask > 0
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(keep)
    last = torch.where(keep, positions, -1).max(-1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = seq_rewards.to(torch.float32)[rows]
    return out


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float = 1.5) -> torch.Tensor:
    """SAO's policy lambda per sequence: clamp(1 - 1 / (alpha * l), 0, 1), l = action-token count.

    Source: SAO arXiv 2607.07508 (decoupled lambda; the clamp to [0, 1] is ours: l = 0 or alpha*l < 1
    would give a negative lambda). Long responses get lambda -> 1 (low bias), short ones lean on the critic.
    """
    if alpha <= 0:
        raise ValueError(f"algorithm.alpha: {alpha} <= 0; fix: use 1.5")
    lengths = lengths.to(torch.float32)
    lam = 1.0 - 1.0 / (alpha * lengths.clamp_min(1e-12))
    return lam.clamp(0.0, 1.0)


@torch.no_grad()
def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                lam: Union[float, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Skip-observation token-level GAE -> (advantages, returns), both 0 off the action tokens.

    Over the action tokens of a row only (t' = the next action token after t, skipping observation
    tokens; V(t') = 0 and A(t') = 0 past the last one):
        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t            (the critic target, the lambda-return)
    So the recursion jumps from the first token of the next action segment to the last token of this one;
    observation tokens get no value, reward or advantage. ``lam`` is a float or a ``[B]`` tensor.
    Sources: GAE arXiv 1506.02438 eq. 16; skip-observation variant SAO arXiv 2607.07508.
    """
    keep = mask > 0
    rows, width = keep.shape
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    r = torch.where(keep, rewards.to(torch.float32), zero)
    v = torch.where(keep, values.detach().to(torch.float32), zero)
    lam = torch.as_tensor(lam, dtype=torch.float32, device=mask.device).expand(rows)
    adv = torch.zeros_like(r)
    next_v = torch.zeros(rows, dtype=torch.float32, device=mask.device)
    next_a = torch.zeros_like(next_v)
    last_col = int(torch.nonzero(keep.any(0)).max()) + 1 if keep.any() else 0
    for t in range(last_col - 1, -1, -1):
        k = keep[:, t]
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        adv[:, t] = torch.where(k, a, zero)
        next_v = torch.where(k, v[:, t], next_v)   # observation tokens leave the carry untouched
        next_a = torch.where(k, a, next_a)
    returns = torch.where(keep, adv + v, zero)
    return adv, returns


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def group_stats(seq_rewards: torch.Tensor, group_ids: torch.Tensor):
    """Per-sample (group size n, group mean, unbiased group std), each ``[B]``; std = 0 when n = 1."""
    x = seq_rewards.to(torch.float32)
    inverse, groups = _group_index(group_ids)
    count = torch.zeros(groups, device=x.device).index_add_(0, inverse, torch.ones_like(x))
    mean = torch.zeros(groups, device=x.device).index_add_(0, inverse, x) / count
    sq = torch.zeros(groups, device=x.device).index_add_(0, inverse, (x - mean[inverse]) ** 2)
    std = torch.where(count > 1, sq / (count - 1).clamp_min(1), torch.zeros_like(sq)).sqrt()
    return count[inverse], mean[inverse], std[inverse]


@torch.no_grad()
def grpo_advantages(seq_rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage: A_i = (r_i - mean_g) / (std_g + eps), std unbiased (n - 1).

    Source: DeepSeekMath arXiv 2402.03300 §4.1.2. A group of one gets A = 0."""
    _, mean, std = group_stats(seq_rewards, group_ids)
    return (seq_rewards.to(torch.float32) - mean) / (std + eps)


@torch.no_grad()
def drgrpo_advantages(seq_rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: A_i = r_i - mean_g (no std division). Source: arXiv 2503.20783 §3.2."""
    _, mean, _ = group_stats(seq_rewards, group_ids)
    return seq_rewards.to(torch.float32) - mean


@torch.no_grad()
def rloo_advantages(seq_rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: A_i = r_i - (1 / (n - 1)) sum_{j != i} r_j = n / (n - 1) * (r_i - mean_g); 0 if n = 1.

    Source: Ahmadian et al. arXiv 2402.14740 §3 (Kool et al. 2019)."""
    count, mean, _ = group_stats(seq_rewards, group_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp_min(1), torch.zeros_like(count))
    return scale * (seq_rewards.to(torch.float32) - mean)


@torch.no_grad()
def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) over the action tokens (unbiased std); 0 elsewhere."""
    keep = mask > 0
    x = torch.where(keep, values.to(torch.float32), torch.zeros((), device=values.device))
    n = keep.sum().clamp_min(1)
    mean = x.sum() / n
    var = torch.where(keep, (x - mean) ** 2, torch.zeros_like(x)).sum() / (n - 1).clamp_min(1)
    return torch.where(keep, (x - mean) / (var.sqrt() + eps), torch.zeros_like(x))


@torch.no_grad()
def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++: discounted return-to-go over action tokens, whitened over the batch's action tokens.

    G_t = sum_{k >= t, action} gamma^(#actions between) r_k (= GAE with V = 0, lambda = 1);
    A = (G - mean) / (std + eps). Source: J. Hu, arXiv 2501.03262 §3 (KL penalty goes into the token
    rewards beforehand: kl.apply_kl_penalty)."""
    returns, _ = compute_gae(token_rewards, torch.zeros_like(token_rewards, dtype=torch.float32), mask, gamma, 1.0)
    return whiten(returns, mask)


@torch.no_grad()
def reinforce_pp_baseline_advantages(seq_rewards: torch.Tensor, group_ids: torch.Tensor,
                                     mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline: A_i = r_i - mean_g, broadcast to the action tokens, whitened over the batch.

    Source: arXiv 2501.03262 (the "-baseline" variant: group-mean baseline, then global normalisation)."""
    return whiten(broadcast_to_tokens(drgrpo_advantages(seq_rewards, group_ids), mask), mask)


def running_mean_advantages(seq_rewards: torch.Tensor, baseline: float | None,
                            momentum: float) -> tuple[torch.Tensor, float]:
    """REINFORCE with a running-mean baseline (the SAO paper's online-learning comparison).

    A_i = r_i - b_prev;  b_new = momentum * b_prev + (1 - momentum) * mean_i r_i.
    b_prev is the baseline before this batch (the batch mean when there is none yet), so a sample's
    advantage never depends on its own reward through the baseline after the first step.
    Returns (seq advantages [B], b_new).
    """
    rewards = seq_rewards.to(torch.float32)
    batch_mean = float(rewards.mean()) if rewards.numel() else 0.0
    previous = batch_mean if baseline is None else float(baseline)
    return rewards - previous, momentum * previous + (1.0 - momentum) * batch_mean


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> ``[B, T]``: the sequence value on each action token, 0 elsewhere."""
    keep = mask > 0
    return torch.where(keep, seq_values.to(torch.float32)[:, None], torch.zeros((), device=mask.device))


def dynamic_sampling_filter(seq_rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: bool keep-mask ``[B]``, False for samples whose whole group has one reward
    (all right or all wrong: zero group advantage, no signal). Source: arXiv 2503.14476 §3.2, eq. 11."""
    x = seq_rewards.to(torch.float32)
    inverse, groups = _group_index(group_ids)
    big = torch.finfo(torch.float32).max
    gmax = torch.full((groups,), -big, device=x.device).scatter_reduce(0, inverse, x, "amax")
    gmin = torch.full((groups,), big, device=x.device).scatter_reduce(0, inverse, x, "amin")
    return (gmax > gmin)[inverse]


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache: int) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476 §3.4, eq. 13), added to the sequence reward:

    0 if |y| <= L_max - L_cache;  (L_max - L_cache - |y|) / L_cache if L_max - L_cache < |y| <= L_max;
    -1 if |y| > L_max.   ``max_len`` = 0 turns it off (all zeros).
    """
    lengths = lengths.to(torch.float32)
    if max_len <= 0:
        return torch.zeros_like(lengths)
    if not 0 < cache <= max_len:
        raise ValueError(f"algorithm.overlong_cache: {cache} not in (0, overlong_max={max_len}]; "
                         "fix: use e.g. overlong_max=20480, overlong_cache=4096")
    start = float(max_len - cache)
    ramp = (start - lengths) / cache
    return torch.where(lengths <= start, torch.zeros_like(lengths),
                       torch.where(lengths <= max_len, ramp, torch.full_like(lengths, -1.0)))
