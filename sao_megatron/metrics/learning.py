"""Learning metrics computed from one step's samples and critic outputs (pure torch, no model).

- `accuracy`: the share of exactly correct answers. Rewards give partial credit (format, leading
  digit), so a rising reward can be format learning alone; accuracy cannot.
- `critic_prediction_metrics`: how well the critic predicted this step's returns *before* it
  trained on them. The critic's own `critic/vf_explained_var` is measured inside its update, after
  K-1 updates on the same batch (in-sample); these are out-of-sample, on fresh rollouts:
    critic/ev_before_update   1 - Var(R - V) / Var(R) over action tokens
    critic/value0_return_corr Pearson correlation, over samples, of the value at the first response
                              token (the critic's prediction of the whole answer's reward, from the
                              prompt alone) with the realised return there
    critic/value0_return_var  Var of that return over the batch (near 0: nothing to explain)
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch


def accuracy(samples: Iterable) -> float:
    """Share of samples whose ``reward_info["correct"]`` is true; without that key, reward >= 1."""
    flags = []
    for sample in samples:
        info = getattr(sample, "reward_info", None) or {}
        if "correct" in info:
            flags.append(float(info["correct"]) > 0.5)
        else:
            flags.append(float(sample.reward or 0.0) >= 1.0)
    return sum(flags) / len(flags) if flags else 0.0


def critic_prediction_metrics(values: Optional[torch.Tensor], returns: Optional[torch.Tensor],
                              mask: torch.Tensor) -> dict:
    """Out-of-sample critic metrics from response-space [B, R] values (pre-update), returns and mask."""
    if values is None or returns is None:
        return {}
    keep = mask > 0
    out = {"critic/ev_before_update": _explained_variance(values[keep], returns[keep])}
    first = keep[:, 0]
    v0, r0 = values[first, 0].double(), returns[first, 0].double()
    out["critic/value0_return_corr"] = _pearson(v0, r0)
    out["critic/value0_return_var"] = float(r0.var(unbiased=False)) if len(r0) else float("nan")
    return out


def _explained_variance(v: torch.Tensor, r: torch.Tensor) -> float:
    v, r = v.double(), r.double()
    var_r = float(r.var(unbiased=False)) if len(r) else 0.0
    if var_r <= 1e-12:
        return float("nan")
    return 1.0 - float((r - v).var(unbiased=False)) / var_r


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    if len(x) < 2:
        return float("nan")
    dx, dy = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((dx * dx).sum()) * float((dy * dy).sum()))
    return float((dx * dy).sum()) / denom if denom > 1e-12 else float("nan")
