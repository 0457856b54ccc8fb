"""Contract: rollout/weights/checksum.py computes what SGLang 0.5.23's /weights_checker computes.

Reads the pinned wheel (build/sglang_wheel/, downloaded by tests/unit/rollout/engines/test_sglang_contract.py) as
text; SGLang is never imported. Pure functions (the CPU tensor hash, the hex formatting, the per-GPU
checksum, the triton hash's finaliser) are executed from their own source on our inputs and must
agree with ours; the triton kernel's constants and the reply layout are pinned from the source text.
"""
from __future__ import annotations

import ast
import importlib.util
import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout.weights import checksum as ours
from rollout.engines.sglang_client import SGLANG_VERSION

CACHE = Path(__file__).resolve().parents[4] / "build" / "sglang_wheel"


@pytest.fixture(scope="module")
def source():
    wheels = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not wheels:
        pytest.skip("the SGLang wheel is not cached: run tests/unit/rollout/engines/test_sglang_contract.py (it downloads it)")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        files = {n: wheel.read(n).decode() for n in wheel.namelist()
                 if n.startswith(("sglang/srt/", "sglang/kernels/ops/memory/")) and n.endswith(".py")}
    return lambda path: files[f"sglang/{path}"]


def _function(text: str, name: str, namespace: dict):
    """Define one top-level function of an SGLang module from its own source, in `namespace`."""
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module([node], []), f"<sglang {name}>", "exec"), namespace)
    return namespace[name]


def _constant(text: str, name: str):
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.Assign) and n.targets[0].id == name)
    return ast.literal_eval(node.value)


def test_cpu_tensor_checksum_is_sglangs_own(source):
    ns = {"torch": torch, "hashlib": hashlib, "gpu_tensor_hash": None, "flatten_nested_list": None}
    tensor_hash = _function(source("srt/managers/mm_utils.py"), "tensor_hash", ns)
    ns["tensor_hash"] = tensor_hash
    hash_tensor = _function(source("srt/utils/weight_checker.py"), "_hash_tensor", ns)
    for t in (torch.randn(3, 5), torch.randn(4, 2).t(), torch.arange(7, dtype=torch.int64),
              torch.randn(6).to(torch.bfloat16), torch.tensor(2.5)):
        assert hash_tensor(t) == ours.tensor_checksum(t)


def test_per_gpu_checksum_skips_and_reply_layout_are_sglangs(source):
    checker = source("srt/utils/weight_checker.py")
    overall = _function(checker, "overall_checksum", {"hashlib": hashlib})
    sums = {"b.weight": "00000000000000bb", "a.weight": "0123456789abcdef", "z": "ffffffffffffffff"}
    assert overall(sums) == ours.overall_checksum(sums)
    assert _constant(checker, "_NON_PERSISTENT_BUFFER_PATTERNS") == ours.NON_PERSISTENT_PATTERNS
    mixin = source("srt/managers/tokenizer_control_mixin.py")
    assert "h.update(info.per_gpu_checksum.encode())" in mixin and "per_engine_checksum = h.hexdigest()" in mixin
    server = source("srt/entrypoints/http_server.py")
    for line in ('@app.api_route("/weights_checker", methods=["GET", "POST"])', 'body["ranks"] = ranks',
                 'body["per_engine_checksum"] = per_engine_checksum',
                 "status_code=200 if success else HTTPStatus.BAD_REQUEST"):
        assert line in server
    io = source("srt/managers/io_struct.py")
    fields = io[io.index("class ParallelismInfo(msgspec.Struct"):io.index("class ChecksumInfo(msgspec.Struct")]
    assert tuple(ln.split(":")[0].strip() for ln in fields.splitlines()[1:] if ":" in ln and not ln.strip()
                 .startswith("#")) == ours.PARALLELISM_FIELDS


def test_triton_hash_constants_and_finaliser_are_sglangs(source):
    kernel = source("kernels/ops/memory/gpu_tensor_hash.py")
    for name, value in (("FMIX32_C1", 0x85EBCA6B), ("FMIX32_C2", 0xC2B2AE35), ("POS_C1", 0x27D4EB2D),
                        ("POS_C2", 0x165667B1)):
        assert _constant(kernel, name) == value
    assert "seed: int = 0x243F6A88" in kernel and "tile_words: int = 8192" in kernel
    assert "seed2=((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF" in kernel
    assert "p1 = (iu * posA + s1) ^ _rotl32(iu, 15)" in kernel and "p2 = (iu * posB + s2) ^ _rotl32(iu, 13)" in kernel
    assert "h1 ^= nbytes" in kernel and "out = (h1.to(tl.uint64) << 32) | h2.to(tl.uint64)" in kernel
    finaliser = _function(kernel, "_final_splitmix64", {})
    rng = np.random.default_rng(0)
    for x in [0, 1, (1 << 64) - 1, *map(int, rng.integers(0, 2**63, 20, dtype=np.uint64))]:
        assert finaliser(x) == ours._splitmix64(x)


def test_triton_kernel_run_by_tritons_interpreter_equals_ours(source, tmp_path, monkeypatch):
    """The kernel itself on CPU (TRITON_INTERPRET=1), where triton is installed (not a project
    dependency: skipped otherwise; tests/gpu/test_weight_checksum_gpu.py runs it compiled on CUDA).
    Its two `is_cuda` guards are the only lines changed, so CPU tensors reach the kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # read when the kernels are decorated, below
    pytest.importorskip("triton", reason="triton is not installed")
    text = source("kernels/ops/memory/gpu_tensor_hash.py")
    guards = ('assert tensor.is_cuda, "Use .cuda() first"', 'assert t.is_cuda, "Use .cuda() first"')
    assert all(g in text for g in guards)
    for guard in guards:
        text = text.replace(guard, "pass")
    path = tmp_path / "sglang_gpu_tensor_hash.py"     # triton reads kernel source from a real file
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("sglang_gpu_tensor_hash_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    for t in (torch.randn(7), torch.randn(100, 37).to(torch.bfloat16), torch.randn(3, 8192 * 5 + 3),
              torch.randint(0, 255, (5,), dtype=torch.uint8)):
        assert f"{module.gpu_tensor_hash(t):016x}" == ours.gpu_checksum(ours.tensor_bytes(t))
