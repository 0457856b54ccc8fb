"""The FP8 quantizer's memory (issue 17.5): quantize_block_fp8 works in chunks of whole 128-row block
rows, so its float32 temporaries stay within max(max_temp_bytes, one block row) instead of about 8
bytes per element of the whole tensor, and its output is the same bytes as one pass; the disk sender
with an FP8 layout holds at most what weight_sync.max_sender_mb counts for it (rollout/weights/memory.py).

Peaks are bench/parallel.py's LiveTensorPeak (tensors created under the mode; the input is not)."""
from __future__ import annotations

import json

import pytest
import torch
from disk_push import disk_push_peak

from bench.parallel import LiveTensorPeak
from rollout.weights import fp8_blocks, memory
from rollout.weights.fp8_blocks import BLOCK, Fp8Layout, quantize_block_fp8, quantize_stream
from rollout.weights.memory import FP8_TEMP_BYTES as TEMP_BYTES, MIB, sender_need

MB = 2 ** 20


def _weight(n: int, k: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(3)).to(dtype)


@pytest.mark.parametrize("shape", [(1024, 2048), (1000, 1900)])   # whole blocks, and short last blocks
def test_chunked_quantization_is_bit_identical_and_its_temporaries_stay_within_one_chunk(shape):
    """Measured (1024 x 2048 bf16): 4.2 MB in chunks of one block row, 18.9 MB in one pass."""
    n, k = shape
    w = _weight(n, k)
    whole_q, whole_scale = quantize_block_fp8(w, max_temp_bytes=1 << 40)   # one pass over the tensor
    with LiveTensorPeak() as unchunked:
        quantize_block_fp8(w, max_temp_bytes=1 << 40)
    budget = MB
    with LiveTensorPeak() as chunked:
        q, scale = quantize_block_fp8(w, max_temp_bytes=budget)
    assert torch.equal(q.view(torch.uint8), whole_q.view(torch.uint8)) and torch.equal(scale, whole_scale)
    padded_k = -(-k // BLOCK[1]) * BLOCK[1]
    one_block_row = TEMP_BYTES * BLOCK[0] * padded_k          # 2 MiB here: above the 1 MiB budget
    outputs = n * k + scale.numel() * 4
    assert chunked.peak <= outputs + max(budget, one_block_row) + 4 * scale.numel() * 4   # amax, masks
    # the whole tensor's float32 copy and quotient (about 8 bytes per element) are gone
    assert unchunked.peak >= outputs + TEMP_BYTES * n * k
    assert chunked.peak < unchunked.peak / 3


def test_budget_counts_the_quantizers_copy_scales_and_one_chunk():
    cfg = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
           "vocab_size": 50000, "intermediate_size": 4096}
    assert memory.largest_linear_elements(cfg) == 2 * 4096 * 1024             # fused gate+up
    assert memory.widest_row_elements(cfg) == 4096                            # down_proj's input
    quantize = memory.fp8_quantize_bytes(cfg)
    assert 2 * 4096 * 1024 + memory.FP8_TEMP_CHUNK < quantize < 2 * 4096 * 1024 * 1.05 + 64 * MIB
    plain = sender_need(cfg, 64 * MIB, 2)
    with_fp8 = sender_need(cfg, 64 * MIB, 2, fp8=True)
    assert with_fp8.total - plain.total == quantize == with_fp8.quantize


def _disk_push_peak(model_dir, tmp_path, monkeypatch, bucket_mb: float) -> tuple[int, dict, dict]:
    """The disk push (tests/support/disk_push.py) with an FP8 layout; returns what it wrote too."""
    from checkpoints.hf_io import HFCheckpoint

    async def landed(engine):
        assert await engine.weight_version() == 1

    peak, hf, _ = disk_push_peak(model_dir, tmp_path / "weights", monkeypatch, bucket_mb, fp8=Fp8Layout(),
                                 after=landed)
    return peak, hf, dict(HFCheckpoint(tmp_path / "weights" / "v1"))


def test_disk_sender_with_fp8_holds_at_most_what_max_sender_mb_counts(tiny_model_dir, tmp_path, monkeypatch):
    """Measured 0.18 MB against the bound 0.41 MB (the quantizer's chunk cut to one 128-row block row)."""
    # one block row per chunk, the tight case: the quantizer reads its chunk where the rule does
    monkeypatch.setattr(memory, "FP8_TEMP_CHUNK", 1)
    bucket_mb = 0.01
    peak, hf, written = _disk_push_peak(tiny_model_dir, tmp_path, monkeypatch, bucket_mb)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    need = sender_need(cfg, bucket_mb * MIB, element_bytes=4, method="disk", fp8=True)
    expected = dict(quantize_stream(hf.items(), Fp8Layout()))
    assert written.keys() == expected.keys() and any(t.dtype == fp8_blocks.WIRE_DTYPE for t in written.values())
    assert all(torch.equal(written[n].view(torch.uint8), t.view(torch.uint8)) for n, t in expected.items())
    assert 0 < peak <= need.total
    assert peak < sum(t.numel() * t.element_size() for t in hf.values()) / 3
