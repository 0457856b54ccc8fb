"""A Megatron-Core bf16 policy step with routing replay on CUDA (the GPU check kit, docs/gpu.md).

The tiny Qwen3-MoE in bf16 on one GPU: the routers record their own top-k on each micro-batch, the
step replays exactly those routes with the configured policy loss (SAO's default, on-policy: rollout
logprobs = the trainer's own), and then
- route agreement is 1.0 (every replayed (token, layer) pair is the router's own choice);
- the step is applied: finite loss, grad norm > 0, the weights moved, nothing skipped;
- the on-policy mismatch |logp_train - logp_rollout| stays within bf16 noise (< 1e-2).
CUDA only (auto-skipped elsewhere by tests/conftest.py).
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from parallel.distributed import run_distributed_test

pytestmark = pytest.mark.gpu


def own_routes(model, batch) -> torch.Tensor:
    """[rows, seq, moe_layers, top_k] int32: the routes the model's routers pick for `batch` (RECORD mode)."""
    from parallel.routing_replay import record_routes

    module = model.modules[0]
    device = next(module.parameters()).device
    tokens = batch.tokens.to(device)
    pos = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    module.eval()
    with torch.no_grad():
        recorded = record_routes(model.modules, lambda: module(tokens, pos, None))
    rows, seq = tokens.shape
    return torch.stack([r.reshape(seq, rows, -1).transpose(0, 1) for r in recorded], dim=2).int().cpu()


def bf16_step_with_own_routes(model_dir: str) -> dict:
    """One rank: build the bf16 policy, replay its own routes through one step; what the test asserts."""
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.rl_model import RLModel
    from sao_megatron.core.config import load_recipe
    from sao_megatron.trainer.steps import policy_loss_fn

    recipe = lc.make_recipe(model_dir, {}, lr=1e-3)
    recipe.model = replace(recipe.model, dtype="bf16")
    algorithm = replace(load_recipe(None, [f"model.path='{model_dir}'"]).algorithm, lr=1e-3)   # SAO's defaults
    model = RLModel.build(recipe, "policy")
    model.load_hf_state_dict(load_file(f"{model_dir}/model.safetensors"))
    param = next(model.modules[0].parameters())
    batches = lc.fixed_batches(model.shape.vocab_size, num=2, seq=16)
    batches = [replace(b, routed_experts=own_routes(model, b)) for b in batches]
    on_policy = [logp.float().cpu() for logp, _ in model.compute_logprobs(batches)]
    batches = [replace(b, rollout_logprobs=lp) for b, lp in zip(batches, on_policy)]
    before = [p.detach().float().clone() for p in model.modules[0].parameters()]
    step = model.train_step(batches, policy_loss_fn(algorithm, norm_len=16.0))
    moved = max(float((p.detach().float() - b).abs().max()) for p, b in zip(model.modules[0].parameters(), before))
    return {"device": param.device.type, "dtype": str(param.dtype), "step": step, "moved": moved}


def test_bf16_policy_step_replays_its_own_routes(tiny_model_dir):
    out = run_distributed_test(bf16_step_with_own_routes, world_size=1, backend="nccl", timeout_s=600,
                               args=(str(tiny_model_dir),))[0]
    step = out["step"]
    assert (out["device"], out["dtype"]) == ("cuda", "torch.bfloat16")
    assert step["route_agreement"] == 1.0
    assert step["skipped"] == 0.0 and math.isfinite(step["loss"]) and step["grad_norm"] > 0
    assert out["moved"] > 0
    assert step["train_rollout_logprob_abs_diff"] < 1e-2
