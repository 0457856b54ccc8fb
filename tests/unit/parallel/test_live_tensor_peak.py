"""bench/parallel.py's LiveTensorPeak (the CPU analogue of torch.cuda.max_memory_allocated): it counts
new tensor storages from the moment an op creates them until they are freed, in forward and backward,
and never counts views, in-place writes or storages that existed before."""
from __future__ import annotations

import torch

from bench.parallel import LiveTensorPeak

MB = 2**20


def test_peak_and_current_follow_allocations_and_frees():
    with LiveTensorPeak() as mode:
        a = torch.empty(MB, dtype=torch.uint8)
        b = torch.empty(2 * MB, dtype=torch.uint8)
        del a
        c = torch.empty(MB // 2, dtype=torch.uint8)
        assert mode.current == 2 * MB + MB // 2
        assert mode.peak == 3 * MB
        del b, c
    assert mode.current == 0 and mode.peak == 3 * MB


def test_views_in_place_ops_and_earlier_storages_are_not_counted():
    before = torch.zeros(MB // 4)                     # 1 MiB of fp32, allocated outside the mode
    with LiveTensorPeak() as mode:
        before.add_(1.0)
        before.view(-1, 4).t()
        before[::2].mul_(2.0)
        assert mode.peak == 0
        fresh = before * 2                              # a new 1 MiB storage
        assert mode.current == MB
        del fresh
    assert mode.current == 0


def test_backward_allocations_are_counted():
    layer = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(8, 256)
    with LiveTensorPeak() as mode:
        loss = layer(x).relu().sum()
        forward_peak = mode.peak
        loss.backward()
    # the weight's gradient (256 x 256 fp32) is created by backward and kept in .grad
    assert mode.current >= 256 * 256 * 4
    assert mode.peak > forward_peak
