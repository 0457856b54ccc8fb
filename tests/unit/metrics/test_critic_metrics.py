"""Critic diagnostics (sao_megatron/metrics/learning.py) on hand-computed vectors, and the console's
first-10 / last-10 summary of rollout/accuracy."""
from __future__ import annotations

import io
import math

import torch

from sao_megatron.metrics.learning import critic_prediction_metrics
from sao_megatron.metrics.sinks import ConsoleSink

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
RETURNS = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]])


def test_perfect_values_explain_everything():
    out = critic_prediction_metrics(RETURNS.clone(), RETURNS, MASK)
    assert out["critic/ev_before_update"] == 1.0
    assert abs(out["critic/value0_return_corr"] - 1.0) < 1e-12


def test_hand_computed_values():
    values = torch.tensor([[0.5, 0.5, 9.0], [0.5, 0.5, 0.5], [0.5, 9.0, 9.0]])   # 9.0 sits on padding
    out = critic_prediction_metrics(values, RETURNS, MASK)
    # action-token returns 1 1 0 0 0 0.5 and a constant 0.5: Var(R - V) = Var(R)
    r = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.5], dtype=torch.float64)
    expected = 1 - float((r - 0.5).var(unbiased=False)) / float(r.var(unbiased=False))
    assert abs(out["critic/ev_before_update"] - expected) < 1e-12 and abs(expected) < 1e-12   # a constant explains none
    assert math.isnan(out["critic/value0_return_corr"])          # a constant prediction has no correlation
    assert abs(out["critic/value0_return_var"] - float(torch.tensor([1.0, 0.0, 0.5]).var(unbiased=False))) < 1e-7


def test_anti_correlated_first_values():
    values = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    out = critic_prediction_metrics(values, RETURNS, MASK)
    assert abs(out["critic/value0_return_corr"] + 1.0) < 1e-12
    assert out["critic/ev_before_update"] < 0


def test_no_critic_no_metrics():
    assert critic_prediction_metrics(None, None, MASK) == {}


def test_console_prints_accuracy_first_and_last_ten():
    stream = io.StringIO()
    sink = ConsoleSink(30, stream=stream)
    for step in range(1, 31):
        sink.log({"rollout/accuracy": 0.1 if step <= 10 else (0.4 if step <= 20 else 0.6), "rollout/raw_reward": 0.5},
                 step)
    sink.close()
    text = stream.getvalue()
    assert "acc 0.600" in text.splitlines()[29]
    assert "accuracy: first 10 steps 0.100 -> last 10 steps 0.600 (+50.0 points)" in text
    assert "raw_reward: first 10 steps 0.500 -> last 10 steps 0.500 (+0.0 points)" in text
