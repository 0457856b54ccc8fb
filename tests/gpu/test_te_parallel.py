"""Transformer Engine path of the trainer (CUDA + TE; auto-skipped elsewhere by tests/conftest.py).

Not run in this project's CPU CI: written against Megatron-Core 0.16.1 + TE, to run with
`pytest -m gpu tests/gpu/test_te_parallel.py` on one GPU.
"""
from __future__ import annotations

import pytest
import torch

from parallel.distributed import run_distributed_test

pytest.importorskip("transformer_engine")


def _te_vs_local(model_dir: str, fp8: str) -> dict:
    from dataclasses import replace

    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    hf = load_file(f"{model_dir}/model.safetensors")
    batches = lc.fixed_batches(105, num=2, seq=32)
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
