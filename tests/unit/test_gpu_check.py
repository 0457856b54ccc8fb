"""The CPU-checkable parts of the GPU check kit (`make gpu-check`, docs/gpu.md):
- the reference server's --device flag: refused with a one-line fix where it cannot work;
- a gloo weight-update group receives on the CPU whatever device the server runs on (nccl receives on it);
- the wheelhouse builder keeps under its cap and says which wheel broke it;
- the device-side script runs its non-GPU logic (collect-only) and writes its summary.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from rollout.reference_server.server import ServeOptions, check_options

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is valid here")
def test_device_cuda_without_a_gpu_names_the_fix(tiny_model_dir):
    with pytest.raises(ValueError, match=r"--device cuda: this machine has no CUDA; use --device cpu"):
        check_options(ServeOptions(model=str(tiny_model_dir), device="cuda"))


@pytest.mark.parametrize("device, needle", [("gpu0", "is not a device"), ("meta", "cpu or cuda only")])
def test_bad_device_is_refused(tiny_model_dir, device, needle):
    with pytest.raises(ValueError, match=needle):
        check_options(ServeOptions(model=str(tiny_model_dir), device=device))


def test_cpu_device_passes(tiny_model_dir):
    check_options(ServeOptions(model=str(tiny_model_dir), device="cpu"))


def test_gloo_group_receives_on_the_cpu_even_for_a_gpu_server():
    from parallel.distributed import free_port
    from rollout.reference_server.weight_group import (destroy_weight_update_group, init_weight_update_group,
                                                       receive_tensors)

    group = init_weight_update_group("127.0.0.1", free_port(), 0, 1, "kit_test", "gloo", timeout_s=30)
    try:
        got = receive_tensors(["a", "b"], [torch.float32, torch.bfloat16], [[2, 3], [4]], group,
                              flattened_bucket=True, device="meta")
        single = receive_tensors(["c"], [torch.int64], [[5]], group, flattened_bucket=False, device="meta")
    finally:
        destroy_weight_update_group(group)
    assert [(n, t.device.type, t.dtype, tuple(t.shape)) for n, t in got + single] == [
        ("a", "cpu", torch.float32, (2, 3)), ("b", "cpu", torch.bfloat16, (4,)), ("c", "cpu", torch.int64, (5,))]
