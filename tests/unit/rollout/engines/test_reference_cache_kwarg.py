"""The reference server hands its KV slab to the model under the name that model's transformers takes.

transformers 5.2x renamed `past_key_values` to `cache` (the old name a deprecated alias until 5.40);
5.17, the version on the lent H200, knows only `past_key_values`, and swallows an unknown `cache=` in
**kwargs: every decode step then ran without its cache and the first generate on the GPU failed with a
mask of the cached length against one key (found by the GPU kit, docs/gpu.md).
"""
from __future__ import annotations

import pytest
import torch

from rollout.engines.reference_server.model_runner import ModelRunner, cache_kwarg


class _Old(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
        return input_ids


class _New(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
        return input_ids


class _NoCache(torch.nn.Module):
    def forward(self, input_ids=None, **kwargs):
        return input_ids


def test_the_cache_goes_under_the_name_the_model_takes():
    assert cache_kwarg(_Old()) == "past_key_values"
    assert cache_kwarg(_New()) == "cache"
    with pytest.raises(RuntimeError, match="neither `cache` nor `past_key_values`"):
        cache_kwarg(_NoCache())


def test_a_decode_step_reads_the_cache_it_wrote(tiny_model_dir):
    """Prompt, then one token per step: the last logits equal a plain forward over the whole sequence,
    which only holds if the decode steps attended to the cached keys."""
    runner = ModelRunner(tiny_model_dir, dtype="fp32", max_batch=2)
    tokens = [3, 7, 11, 5, 9]
    runner.forward([tokens[:3]], [0], want_routes=False)
    runner.forward([[tokens[3]]], [3], want_routes=False)
    step = runner.forward([[tokens[4]]], [4], want_routes=False)
    full, _ = runner.teacher_forced(tokens)
    assert torch.allclose(step.last_logits[0], full[-1], atol=1e-5)
