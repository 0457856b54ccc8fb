"""Megatron-Core 0.16.1 on a machine without Transformer Engine, outside the CPU shim (a GPU with
transformer_impl = "local"): the router GEMM names `te_general_gemm`, which moe_utils defines only when
TE imports. The GPU kit hit the NameError on an H200; parallel.model_build defines the name as None.
Run in a fresh interpreter, since the CPU shim (installed by other tests) defines it as well.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    from megatron.core.transformer.moe import moe_utils
    assert not moe_utils.HAVE_TE, "this check is for machines without Transformer Engine"
    x, w = torch.randn(5, 8), torch.randn(4, 8)
    try:
        moe_utils.router_gating_linear(x, w, None, torch.float32)
    except NameError as err:
        print("BEFORE", err)
    from parallel.model_build import define_missing_te_names
    define_missing_te_names()
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    assert torch.allclose(out, x @ w.t(), atol=1e-6)
    print("AFTER ok")
""")


def test_router_gemm_runs_without_transformer_engine():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "BEFORE name 'te_general_gemm' is not defined" in done.stdout   # Megatron's bug is still there
    assert "AFTER ok" in done.stdout
