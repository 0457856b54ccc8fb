"""The GPU MoE path under Transformer Engine (CUDA + TE; auto-skipped elsewhere by tests/conftest.py):
the kernels parallel/fusions.py chooses are the ones built (TEGroupedMLP experts, permute and SwiGLU fusion),
and packed THD micro-batches give the padded path's logprobs and step in bf16 with replayed routes.
Not run in this project's CPU CI (no GPU was available when it was written): run with
`pytest -m gpu tests/gpu/test_packed_te.py` on one GPU. The CPU twin is tests/distributed/test_packed_sequences.py.
"""
from __future__ import annotations

import pytest

from parallel.distributed import run_distributed_test

pytest.importorskip("transformer_engine")


def _padded_vs_packed(model_dir: str) -> dict:
    from dataclasses import replace

    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    hf = load_file(f"{model_dir}/model.safetensors")
    padded = lc.fixed_batches(105, num=2, rows=3, seq=32, num_layers=4, top_k=2, num_experts=8)
    out = {"lengths": [b.lengths for b in padded]}
    for mode, batches in (("padded", padded), ("packed", [replace(b, packed=True) for b in padded])):
        teardown_model_parallel()
        recipe = lc.make_recipe(model_dir, {})
        recipe.model = replace(recipe.model, transformer_impl="transformer_engine", dtype="bf16")
        model = RLModel.build(recipe, "policy")
        model.load_hf_state_dict(hf)
        experts = type(model.modules[0].decoder.layers[0].mlp.experts).__name__
        out[mode] = {"logp": [lp.cpu() for lp, _ in model.compute_logprobs(batches)],
                     "step": model.train_step(batches, lc.policy_gradient_loss), "experts": experts,
                     "config": {k: getattr(model.config, k) for k in ("moe_grouped_gemm", "moe_permute_fusion",
                                                                      "bias_activation_fusion", "apply_rope_fusion")}}
    teardown_model_parallel()
    return out


def test_te_builds_grouped_experts_and_packed_equals_padded_in_bf16(tiny_model_dir):
    out = run_distributed_test(_padded_vs_packed, world_size=1, backend="nccl", timeout_s=600,
                               args=(str(tiny_model_dir),))[0]
    assert out["padded"]["experts"] == "TEGroupedMLP" and all(out["padded"]["config"].values())
    for a, b, n in zip(out["padded"]["logp"], out["packed"]["logp"], out["lengths"]):
        real = (a.new_ones(a.shape).cumsum(1) <= n.unsqueeze(1).to(a.device)).bool()
        assert float((a - b)[real].abs().mean()) < 1e-2 and float((a - b)[real].abs().max()) < 0.1   # bf16 kernels
    pad, pack = out["padded"]["step"], out["packed"]["step"]
    assert pack["skipped"] == 0.0 and abs(pad["loss"] - pack["loss"]) <= 0.02 * abs(pad["loss"]) + 1e-3
    assert abs(pad["grad_norm"] - pack["grad_norm"]) <= 0.05 * pad["grad_norm"]
