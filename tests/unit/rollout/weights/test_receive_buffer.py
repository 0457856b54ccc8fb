"""Receivers reuse one flat buffer across buckets (rollout/weights/buckets.py ReceiveBuffer), grown only when a
bucket is larger, and what they hand on never aliases it (the next bucket overwrites it)."""
from __future__ import annotations

import torch

from rollout.engines.reference_server.weight_group import flatten_bucket, unflatten_bucket
from rollout.weights.buckets import ReceiveBuffer


def test_the_buffer_is_reused_and_grown_only_when_a_bucket_is_larger():
    buffer = ReceiveBuffer()
    first = buffer.take(1000)
    assert first.numel() == 1000 and first.dtype == torch.uint8
    assert buffer.take(600).data_ptr() == first.data_ptr()        # smaller: the same memory
    assert buffer.take(1000).data_ptr() == first.data_ptr()
    grown = buffer.take(4000)
    assert grown.numel() == 4000 and buffer.flat.numel() == 4000
    assert buffer.take(1000).data_ptr() == grown.data_ptr()       # kept at its largest size


def test_tensors_unflattened_from_the_buffer_survive_the_next_bucket():
    """The reference server receives into the reused buffer and unflattens copies: bucket 1's tensors keep
    their values after bucket 2 lands in the same memory."""
    buffer = ReceiveBuffer()
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    flat = buffer.take(a.numel() * 4)
    flat.copy_(flatten_bucket([a]))
    (name, got), = unflatten_bucket(flat, ["a"], [torch.float32], [[2, 3]])
    buffer.take(a.numel() * 4).fill_(0)                           # the next bucket overwrites the buffer
    assert name == "a" and torch.equal(got, a)


def test_the_reference_server_loads_views_of_the_buffer_and_copies_only_misaligned_tensors():
    """receive_tensors hands the loader views of the reused buffer (the load's copy into the model is the
    only one); a tensor whose offset does not fit its element size cannot be viewed and is copied."""
    a, b = torch.arange(6, dtype=torch.float32), torch.arange(3, dtype=torch.bfloat16)
    flat = flatten_bucket([a, b])
    views = unflatten_bucket(flat, ["a", "b"], [torch.float32, torch.bfloat16], [[6], [3]], copy=False)
    assert [v.data_ptr() for _, v in views] == [flat.data_ptr(), flat.data_ptr() + 24]
    assert torch.equal(views[0][1], a) and torch.equal(views[1][1], b)
    odd = flatten_bucket([torch.ones(1, dtype=torch.uint8), a])               # a at byte offset 1
    (_, one), (_, got) = unflatten_bucket(odd, ["o", "a"], [torch.uint8, torch.float32], [[1], [6]], copy=False)
    assert one.data_ptr() == odd.data_ptr() and got.data_ptr() != odd.data_ptr() + 1 and torch.equal(got, a)
