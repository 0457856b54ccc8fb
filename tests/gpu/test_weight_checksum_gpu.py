"""Our CPU reproduction of SGLang's triton tensor hash (rollout/weights/checksum.py gpu_checksum) equals
the kernel itself on CUDA tensors: the hash a real SGLang engine reports from /weights_checker.

The kernel comes from the installed sglang, or else from the pinned wheel cached under
build/sglang_wheel/ (its gpu_tensor_hash.py needs only torch and triton). Skipped without CUDA.
"""
from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest
import torch

from rollout.engines.sglang_client import SGLANG_VERSION
from rollout.weights.checksum import gpu_checksum, tensor_bytes, tensor_checksum

KERNEL = "sglang/kernels/ops/memory/gpu_tensor_hash.py"


def _sglang_gpu_hash():
    pytest.importorskip("triton", reason="SGLang's tensor hash is a triton kernel")
    try:
        from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash
        return gpu_tensor_hash
    except ImportError:
        pass
    root = Path(__file__).resolve().parents[2] / "build"
    wheels = sorted((root / "sglang_wheel").glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not wheels:
        pytest.skip("neither sglang nor its wheel in build/sglang_wheel/ is available")
    path = root / "sglang_gpu_tensor_hash.py"    # triton's jit reads kernel source from a real file
    with zipfile.ZipFile(wheels[-1]) as wheel:
        path.write_bytes(wheel.read(KERNEL))
    spec = importlib.util.spec_from_file_location("sglang_gpu_tensor_hash", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gpu_tensor_hash


@pytest.mark.parametrize("shape, dtype", [((7,), torch.float32), ((1000, 37), torch.bfloat16),
                                          ((3, 8192 * 5 + 3), torch.float32), ((5,), torch.uint8),
                                          ((0,), torch.float32)])
def test_cpu_reproduction_equals_the_triton_kernel(shape, dtype):
    gpu_tensor_hash = _sglang_gpu_hash()
    t = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.randint(0, 255, shape, dtype=dtype)
    cuda = t.cuda()
    assert f"{gpu_tensor_hash(cuda):016x}" == gpu_checksum(tensor_bytes(t)) == tensor_checksum(cuda)
