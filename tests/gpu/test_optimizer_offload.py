"""Optimizer CPU offload (parallel.optimizer_offload): Megatron's HybridDeviceOptimizer keeps Adam state
and fp32 master weights on the host. Two steps with it give the same losses as the distributed
optimizer on the GPU. CUDA only (auto-skipped elsewhere by tests/conftest.py); never run in CPU CI."""
from __future__ import annotations

from dataclasses import replace

import pytest

from parallel.distributed import run_distributed_test

pytestmark = pytest.mark.gpu


def _two_steps(model_dir: str, offload: bool) -> list[tuple[float, float]]:
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.rl_model import RLModel

    recipe = lc.make_recipe(model_dir, {"distributed_optimizer": True}, lr=1e-2)
    recipe.parallel = replace(recipe.parallel, optimizer_offload=offload)
    model = RLModel.build(recipe, "policy")
    model.load_hf_state_dict(load_file(f"{model_dir}/model.safetensors"))
    batches = lc.fixed_batches(105, num=4, seq=12)
    out = [model.train_step(batches[i * 2:i * 2 + 2], lc.policy_gradient_loss) for i in range(2)]
    return [(m["loss"], m["grad_norm"]) for m in out]


def test_offloaded_adam_matches_the_gpu_optimizer(tiny_model_dir):
    on_gpu = run_distributed_test(_two_steps, world_size=1, backend="nccl", timeout_s=600,
                                  args=(str(tiny_model_dir), False))[0]
    offloaded = run_distributed_test(_two_steps, world_size=1, backend="nccl", timeout_s=600,
                                     args=(str(tiny_model_dir), True))[0]
    for (loss_a, norm_a), (loss_b, norm_b) in zip(on_gpu, offloaded):
        assert loss_b == pytest.approx(loss_a, rel=1e-4) and norm_b == pytest.approx(norm_a, rel=1e-3)
