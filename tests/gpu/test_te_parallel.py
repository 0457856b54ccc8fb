"""Transformer Engine path of the trainer (CUDA + TE; auto-skipped elsewhere by tests/conftest.py).

Not run in this project's CPU CI: written against Megatron-Core 0.16.1 + TE, to run with
`pytest -m gpu tests/gpu/test_te_parallel.py` on one GPU (the context-parallel case needs two).
"""
from __future__ import annotations

import pytest
import torch

from parallel.distributed import run_distributed_test

pytest.importorskip("transformer_engine")


def _te_vs_local(model_dir: str, fp8: str, rows: int = 2, seq: int = 32) -> dict:
    from dataclasses import replace

    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    hf = load_file(f"{model_dir}/model.safetensors")
    batches = lc.fixed_batches(105, num=2, rows=rows, seq=seq)
    out = {}
    for impl in ("local", "transformer_engine"):
        teardown_model_parallel()
        recipe = lc.make_recipe(model_dir, {})
        recipe.model = replace(recipe.model, transformer_impl=impl, fp8=fp8 if impl == "transformer_engine" else "none")
        model = RLModel.build(recipe, "policy")
        model.load_hf_state_dict(hf)
        out[impl] = {"logp": [lp.cpu() for lp, _ in model.compute_logprobs(batches)],
                     "step": model.train_step(batches, lc.policy_gradient_loss),
                     "names": sorted(n for n, _ in model.modules[0].named_parameters())}
    teardown_model_parallel()
    return out


def test_te_spec_matches_local_spec_in_fp32(tiny_model_dir):
    out = run_distributed_test(_te_vs_local, world_size=1, backend="nccl", timeout_s=600,
                               args=(str(tiny_model_dir), "none"))[0]
    delta = max(float((a - b).abs().max()) for a, b in zip(out["local"]["logp"], out["transformer_engine"]["logp"]))
    assert delta < 1e-4  # TF32/cuBLAS kernels vs the same math
    assert any("layer_norm_weight" in n for n in out["transformer_engine"]["names"])  # fused norms mapped


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_fp8_recipes_build_and_step(tiny_model_dir, recipe):
    major, _ = torch.cuda.get_device_capability()
    if recipe == "mxfp8" and major < 10:
        pytest.skip("mxfp8 needs Blackwell (sm100)")
    if recipe == "blockwise" and major != 9:
        pytest.skip("blockwise FP8 is the Hopper recipe")
    out = run_distributed_test(_te_vs_local, world_size=1, backend="nccl", timeout_s=600,
                               args=(str(tiny_model_dir), recipe))[0]
    step = out["transformer_engine"]["step"]
    assert step["skipped"] == 0.0 and step["grad_norm"] > 0
    delta = max(float((a - b).abs().max()) for a, b in zip(out["local"]["logp"], out["transformer_engine"]["logp"]))
    assert delta < 0.5  # FP8 GEMMs: logprobs stay close to fp32, not equal


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_step_with_an_odd_token_count(tiny_model_dir, recipe):
    """3 rows x 21 positions: TE's FP8 GEMMs need whole blocks of tokens, so the trainer pads the
    micro-batch to 32 positions (packing.seq_multiple); results come back at the batch's 21."""
    out = run_distributed_test(_te_vs_local, world_size=1, backend="nccl", timeout_s=600,
                               args=(str(tiny_model_dir), recipe, 3, 21))[0]
    step = out["transformer_engine"]["step"]
    assert step["skipped"] == 0.0 and step["grad_norm"] > 0
    assert all(tuple(lp.shape) == (3, 21) for lp in out["transformer_engine"]["logp"])
    delta = max(float((a - b).abs().max()) for a, b in zip(out["local"]["logp"], out["transformer_engine"]["logp"]))
    assert delta < 0.5


def _cp_vs_dp(model_dir: str) -> dict:
    from parallel import layout_check as lc

    layouts = {"dp2": {}, "cp2": {"cp": 2}}
    return lc.run_layouts(model_dir, ["dp2", "cp2"], layouts=layouts, seq=21, routes=True)   # 21: padded to 24


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="cp = 2 needs two GPUs")
def test_context_parallel_equals_one_rank_per_sequence(tiny_model_dir):
    """cp = 2 (each rank holds chunks r and 3-r of every sequence, TE attention exchanges K/V) gives
    the logprobs, loss and grad norm of cp = 1 on the same two GPUs (dp = 2), routes replayed."""
    from parallel import layout_check as lc

    out = run_distributed_test(_cp_vs_dp, world_size=2, backend="nccl", timeout_s=600, args=(str(tiny_model_dir),))[0]
    delta = lc.compare(out["cp2"], out["dp2"])
    assert delta["logp"] < 1e-4 and delta["loss"] < 1e-5 and delta["grad_norm"] < 1e-4
    assert delta.get("route_agreement", 0.0) == 0.0
