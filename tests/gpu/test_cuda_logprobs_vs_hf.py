"""Trainer (Megatron-Core) logprobs vs HF transformers logprobs, both on CUDA (the GPU check kit).

Models: the tiny Qwen3-MoE and the tiny GLM-4.5 (first layer dense, shared expert, qkv bias, router
score-correction bias). HF runs through the reference server's ModelRunner (its teacher-forced
forward and router capture), the trainer through RLModel.compute_logprobs. Stated tolerances:
- fp32, each side routing on its own: max |trainer - HF| < 2e-4 (same math, other kernels; matmuls
  without TF32, as torch defaults);
- bf16: the trainer replays the routes HF took in bf16, as it replays an engine's in RL (without
  replay, near-tied router scores flip experts between the two kernel sets and the delta measures
  the flip). The trainer in bf16 must be no further from fp32 HF than HF's own bf16 run is, with
  slack: mean |trainer_bf16 - HF_fp32| <= 2 * mean |HF_bf16 - HF_fp32| + 5e-4, and
  max |trainer_bf16 - HF_bf16| < 0.02 (on CPU: means ~1e-3, max 3e-3; one flipped expert moves a
  logprob ~1e-2).
CUDA only (auto-skipped elsewhere by tests/conftest.py).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel.distributed import run_distributed_test

pytestmark = pytest.mark.gpu

SEQ = 16


def hf_logprobs(model_dir: str, dtype: str, device: str, batches) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per batch: HF logprobs [rows, seq] in the trainer's convention (0 at t=0 and past each length)
    and the routes [rows, seq, layers, k] HF took (-1 past each length)."""
    from rollout.engines.reference_server.model_runner import ModelRunner

    runner = ModelRunner(model_dir, dtype=dtype, device=device)
    logps, routes = [], []
    for batch in batches:
        rows, seq = batch.tokens.shape
        logp = torch.zeros(rows, seq)
        taken = None
        for b in range(rows):
            n = int(batch.lengths[b])
            tokens = batch.tokens[b, :n].tolist()
            logits, r = runner.teacher_forced(tokens)
            logp[b, 1:n] = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
            if taken is None:
                taken = torch.full((rows, seq, *r.shape[1:]), -1, dtype=torch.int32)
            taken[b, :n] = r
        logps.append(logp)
        routes.append(taken)
    del runner
    return logps, routes


def trainer_logprobs(model_dir: str, dtype: str, batches) -> list[torch.Tensor]:
    """One rank: RLModel in `dtype` on this rank's device; logprobs of `batches` (routes replayed if given)."""
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    teardown_model_parallel()
    recipe = lc.make_recipe(model_dir, {})
    recipe.model = replace(recipe.model, dtype=dtype)
    model = RLModel.build(recipe, "policy")
    model.load_hf_state_dict(load_file(f"{model_dir}/model.safetensors"))
    out = [logp.float().cpu() for logp, _ in model.compute_logprobs(batches)]
    teardown_model_parallel()
    return out


def all_trainer_runs(cases: dict) -> dict:
    """cases: name -> (model_dir, dtype, batches); one Megatron build per case in this rank."""
    return {name: trainer_logprobs(*case) for name, case in cases.items()}


def _valid_deltas(ours: list[torch.Tensor], theirs: list[torch.Tensor], batches) -> torch.Tensor:
    """|ours - theirs| over positions 1..length-1 of every row (where a logprob exists)."""
    out = []
    for a, b, batch in zip(ours, theirs, batches):
        pos = torch.arange(a.shape[1])[None, :]
        real = (pos >= 1) & (pos < batch.lengths[:, None])
        out.append((a - b).abs()[real])
    return torch.cat(out)


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory):
    from checkpoints.tiny_models import make_tiny_hf

    glm = make_tiny_hf(tmp_path_factory.mktemp("glm45") / "model", "glm4_moe", seed=1)
    return {"qwen3_moe": str(tiny_model_dir), "glm4_moe": str(glm)}


@pytest.fixture(scope="module")
def measured(model_dirs):
    """Every HF run in this process on CUDA, every trainer run in one spawned nccl rank."""
    from parallel import layout_check as lc

    batches = lc.fixed_batches(105, num=2, seq=SEQ)
    hf, cases = {}, {}
    for arch, path in model_dirs.items():
        hf[arch, "fp32"], _ = hf_logprobs(path, "fp32", "cuda", batches)
        hf[arch, "bf16"], routes = hf_logprobs(path, "bf16", "cuda", batches)
        cases[f"{arch}/fp32"] = (path, "fp32", batches)
        cases[f"{arch}/bf16"] = (path, "bf16", [replace(b, routed_experts=r) for b, r in zip(batches, routes)])
    ours = run_distributed_test(all_trainer_runs, world_size=1, backend="nccl", timeout_s=600, args=(cases,))[0]
    return hf, ours, batches


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_fp32_trainer_matches_hf_on_cuda(measured, arch):
    hf, ours, batches = measured
    delta = _valid_deltas(ours[f"{arch}/fp32"], hf[arch, "fp32"], batches)
    assert delta.numel() > 20 and delta.max().item() < 2e-4


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_bf16_trainer_with_hf_routes_within_bf16_error(measured, arch):
    hf, ours, batches = measured
    trainer_err = _valid_deltas(ours[f"{arch}/bf16"], hf[arch, "fp32"], batches).mean().item()
    hf_err = _valid_deltas(hf[arch, "bf16"], hf[arch, "fp32"], batches).mean().item()
    assert trainer_err <= 2 * hf_err + 5e-4, (trainer_err, hf_err)
    assert _valid_deltas(ours[f"{arch}/bf16"], hf[arch, "bf16"], batches).max().item() < 0.02
