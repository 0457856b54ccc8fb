"""Loss aggregation over ``[batch, seq]`` per-token terms, and how metrics combine across micro-batches.

Why global denominators: under gradient accumulation a step is split into micro-batches (and across
data-parallel ranks). If each micro-batch divided by its own token count, short micro-batches would
weigh as much as long ones and the step's gradient would depend on how it was split (Known bug 1).
The caller therefore passes the *whole step's* counts; each micro-batch returns
``sum(its terms) / global_count``, and the sum of the micro-batch losses is the full-batch loss.

Modes (``AlgorithmConfig.loss_agg``; l = per-token loss, m = action mask, n_i = sum_t m_it,
N = global action tokens, S = global sequences with >= 1 action token, L = ``norm_len``):

- ``token-mean``               sum_it m l / N                    (DAPO, arXiv 2503.14476 §3.3)
- ``seq-mean-token-sum``       sum_i (sum_t m l) / S
- ``seq-mean-token-mean``      sum_i (sum_t m l / n_i) / S       (GRPO, arXiv 2402.03300 eq. 3)
- ``seq-mean-token-sum-norm``  sum_i (sum_t m l) / (S * L)       (Dr. GRPO, arXiv 2503.20783: a
  constant normaliser, the generation budget, instead of 1/|o_i|). L must be the same constant in every
  micro-batch; by default it is the padded width ``mask.shape[-1]``, which is only split-invariant
  when every micro-batch is padded alike, so pass ``norm_len`` (e.g. ``rollout.max_new_tokens``).

Metrics: every key a loss returns is *additive*: token metrics are ``sum(values over this micro-batch's
action tokens) / N``, so summing a key over micro-batches and DP ranks (all-reduce SUM) gives the
step's token mean. Exceptions, by name: keys ending in ``_max`` combine with max, keys ending in
``_min`` with min, and ``vf_explained_var`` is recomputed from the additive value moments
(see ``finalize_metrics``). ``combine_metrics`` does all of this.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Aggregation:
    """How per-token terms become one scalar, with the step's global counts (None = this batch's)."""

    mode: str = "token-mean"
    global_num_tokens: Optional[float] = None
    global_num_seqs: Optional[float] = None
    norm_len: Optional[float] = None

    def __post_init__(self):
        if self.mode not in AGG_MODES:
            raise ValueError(f"algorithm.loss_agg: unknown mode {self.mode!r}; fix: use one of {', '.join(AGG_MODES)}")
        if self.norm_len is not None and self.norm_len <= 0:
            raise ValueError(f"norm_len: {self.norm_len} <= 0; fix: pass the generation budget in tokens")

    def num_tokens(self, keep: torch.Tensor) -> torch.Tensor:
        """N: the global action-token count, checked against this micro-batch's own count."""
        local = keep.sum().to(torch.float32)
        return _global_or_local(self.global_num_tokens, local, "global_num_tokens", "action tokens")

    def num_seqs(self, keep: torch.Tensor) -> torch.Tensor:
        """S: the global count of sequences with at least one action token."""
        local = (keep.sum(-1) > 0).sum().to(torch.float32)
        return _global_or_local(self.global_num_seqs, local, "global_num_seqs", "sequences with action tokens")

    def loss(self, per_token: torch.Tensor, keep: torch.Tensor,
             count_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Aggregate ``per_token`` over ``keep`` (bool). ``count_mask`` (bool) replaces ``keep`` in the
        token counts only (DIS ``normalize_over='kept'``)."""
        summed = torch.where(keep, per_token, torch.zeros_like(per_token))
        if self.mode == "token-mean":
            return summed.sum() / self._token_denominator(keep, count_mask)
        seq_sum = summed.sum(-1)
        if self.mode == "seq-mean-token-mean":
            counts = (keep if count_mask is None else count_mask).sum(-1).clamp_min(1)
            seq_sum = seq_sum / counts
        elif self.mode == "seq-mean-token-sum-norm":
            seq_sum = seq_sum / float(self.norm_len or per_token.shape[-1])
        return seq_sum.sum() / self.num_seqs(keep)

    def token_mean(self, values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Additive metric: sum of ``values`` over action tokens / N, detached, 0-d."""
        values = values.detach().to(torch.float32)
        if values.shape != keep.shape:
            values = values.expand_as(keep)
        return torch.where(keep, values, torch.zeros_like(values)).sum() / self.num_tokens(keep)

    def _token_denominator(self, keep, count_mask):
        if count_mask is None:
            return self.num_tokens(keep)
        kept = count_mask.sum().to(torch.float32)
        if self.global_num_tokens is None:
            return kept.clamp_min(1)
        # The global kept count is only known after every micro-batch's forward pass; estimate it from
        # this micro-batch's kept fraction (exact with one micro-batch per step).
        local = keep.sum().to(torch.float32).clamp_min(1)
        return (self.num_tokens(keep) * kept / local).clamp_min(1)


def _global_or_local(global_count, local, name, what):
    if global_count is None:
        return local.clamp_min(1)
    if float(global_count) + 1e-6 < float(local):
        raise ValueError(f"{name}={global_count} is below this micro-batch's {int(local)} {what}; fix: pass the "
                         "count of the whole optimizer step (all micro-batches and data-parallel ranks)")
    return torch.tensor(max(float(global_count), 1.0), dtype=torch.float32, device=local.device)


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
                   global_num_tokens: Optional[float] = None, global_num_seqs: Optional[float] = None,
                   norm_len: Optional[float] = None) -> torch.Tensor:
    """Functional form of ``Aggregation(mode, ...).loss(per_token, mask > 0)`` (formulas in the module doc)."""
    agg = Aggregation(mode, global_num_tokens, global_num_seqs, norm_len)
    return agg.loss(per_token, mask > 0)


def reduction(key: str) -> str:
    """How a metric combines over micro-batches and ranks: "max" for ``*_max``, "min" for ``*_min``,
    else "sum" (the additive keys, already divided by the step's global token count)."""
    return "max" if key.endswith("_max") else "min" if key.endswith("_min") else "sum"


def combine_metrics(parts: Iterable[dict]) -> dict:
    """Combine the metrics of the micro-batches of one step by ``reduction``: sum, except ``*_max`` (max),
    ``*_min`` (min); then ``finalize_metrics``. Across DP ranks do the same with all-reduce SUM / MAX / MIN."""
    combine = {"sum": lambda a, b: a + b, "max": max, "min": min}
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            value = float(value)
            out[key] = value if key not in out else combine[reduction(key)](out[key], value)
    return finalize_metrics(out)


def finalize_metrics(summed: dict) -> dict:
    """Recompute the non-additive ``vf_explained_var`` from the summed value moments, if present.

    EV = 1 - Var(R - V) / Var(R) over all action tokens of the step, with Var(x) = E[x^2] - E[x]^2 taken
    from the additive keys return_mean, return_sq_mean, vf_resid_mean, vf_resid_sq_mean. NaN when
    Var(R) = 0 (every return equal: explained variance is undefined, not 0).
    """
    keys = ("return_mean", "return_sq_mean", "vf_resid_mean", "vf_resid_sq_mean")
    out = dict(summed)
    if all(k in out for k in keys):
        r, r2, e, e2 = (float(out[k]) for k in keys)
        out["vf_explained_var"] = explained_variance_from_moments(r, r2, e, e2)
    return out


def explained_variance_from_moments(r_mean, r_sq_mean, resid_mean, resid_sq_mean) -> float:
    """1 - Var(resid)/Var(R) from first and second moments; NaN if Var(R) is (numerically) 0."""
    var_r = r_sq_mean - r_mean * r_mean
    var_e = resid_sq_mean - resid_mean * resid_mean
    if var_r <= 1e-12 * max(1.0, r_sq_mean):
        return math.nan
    return 1.0 - var_e / var_r
