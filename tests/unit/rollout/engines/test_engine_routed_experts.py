"""Routed experts on the wire: base64 of little-endian int32 [tokens, layers, topk] (SGLang's encoding)."""
from __future__ import annotations

import base64

import pytest
import torch

from rollout.engines.routed_experts import decode_routed_experts, encode_routed_experts


def test_round_trip_and_byte_layout():
    routes = torch.tensor([[[1, 7], [0, 3]], [[5, 2], [6, 4]], [[3, 3], [1, 0]]], dtype=torch.int32)
    text = encode_routed_experts(routes)
    raw = base64.b64decode(text)
    assert raw[:8] == bytes([1, 0, 0, 0, 7, 0, 0, 0])       # C order, little-endian int32
    assert len(raw) == 3 * 2 * 2 * 4
    back = decode_routed_experts(text, num_tokens=3, top_k=2, num_layers=2)
    assert back.dtype == torch.int32 and torch.equal(back, routes)


@pytest.mark.parametrize("text, tokens, topk, layers, needle", [
    ("!!notbase64!!", 1, 2, None, "not valid base64"),
    (base64.b64encode(b"\x00" * 6).decode(), 1, 1, None, "whole number"),
    (encode_routed_experts(torch.zeros(2, 3, 2)), 5, 2, None, "not divisible"),
    (encode_routed_experts(torch.zeros(2, 3, 2)), 2, 2, 4, "expected 4"),
    (encode_routed_experts(-torch.ones(1, 1, 2)), 1, 2, None, "negative"),
])
def test_bad_payloads_are_named(text, tokens, topk, layers, needle):
    with pytest.raises(ValueError, match=needle):
        decode_routed_experts(text, tokens, topk, layers)


def test_empty_sequence_decodes_to_zero_rows():
    assert decode_routed_experts("", 0, 2, 4).shape == (0, 4, 2)
