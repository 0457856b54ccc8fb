"""Block-FP8 weight updates on a GPU (issue 17.1). The trainer quantizes on its GPU, so the bytes it sends
must be the bytes the CPU tests pin (tests/unit/rollout/weights/test_fp8_blocks.py, test_sglang_contract_fp8.py); and the
wire format (float8_e4m3fn in 128x128 blocks, a float32 scale that *multiplies*) must compute, in Hopper's
FP8 tensor-core GEMM, what the dequantized bf16 weight computes. SGLang's block GEMM does per block what
the loop below does with torch._scaled_mm. CUDA only (auto-skipped elsewhere by tests/conftest.py).
"""
from __future__ import annotations

import pytest
import torch

from rollout.weights.fp8_blocks import BLOCK, dequantize_block_fp8, quantize_block_fp8

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (128, 128), (7, 300)])
def test_quantizing_on_the_gpu_gives_the_cpu_bytes(shape):
    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    w[0, :5] = 0.0
    q_cpu, s_cpu = quantize_block_fp8(w)
    q_gpu, s_gpu = quantize_block_fp8(w.cuda(), max_temp_bytes=1)   # one block row per chunk
    assert torch.equal(q_gpu.view(torch.uint8).cpu(), q_cpu.view(torch.uint8))
    assert torch.equal(s_gpu.cpu(), s_cpu)


def test_hopper_fp8_gemm_on_our_blocks_matches_the_dequantized_weight():
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        pytest.skip("FP8 tensor cores need compute capability 9.0 (Hopper) or newer")
    g = torch.Generator().manual_seed(0)
    n, k, m = 256, 384, 32
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).cuda()
    w[:128, :128] *= 40.0                          # blocks of very different amax: each needs its own scale
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    q, scale = quantize_block_fp8(w)
    x_scale = x.float().abs().amax() / 448.0
    xq = (x.float() / x_scale).to(torch.float8_e4m3fn)
    bn, bk = BLOCK
    out = torch.zeros(m, n, dtype=torch.float32, device="cuda")
    for i in range(n // bn):
        for j in range(k // bk):
            a = xq[:, j * bk:(j + 1) * bk].contiguous()
            b = q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].contiguous().t()     # column-major, as cuBLASLt wants
            out[:, i * bn:(i + 1) * bn] += torch._scaled_mm(     # cuBLASLt's FP8 GEMM has no fp32 output
                a, b, scale_a=x_scale.reshape(()), scale_b=scale[i, j].reshape(()).float(),
                out_dtype=torch.bfloat16).float()
    reference = xq.float() * x_scale @ dequantize_block_fp8(q, scale, torch.float32).t()
    assert torch.allclose(out, reference, rtol=1e-2, atol=1e-2 * float(reference.abs().max()))   # bf16 partials
    # and the quantized weight is close to the bf16 one (the scale multiplies: a divided scale is off by amax^2)
    exact = x.float() @ w.float().t()
    rel = float((out - exact).norm() / exact.norm())
    assert rel < 0.1, rel
