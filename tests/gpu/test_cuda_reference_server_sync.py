"""The reference server on CUDA behind the trainer's weight-sync path (the GPU check kit, docs/gpu.md).

A Megatron trainer rank on cuda:0 takes one optimizer step, export_hf() streams its HF tensors, and
BroadcastWeightSync sends them to `python -m rollout.engines.reference_server --device cuda...`; then
- the server holds the trainer's tensors bit for bit (check_weight_update_equal: /weights_checker
  checksums of the server's 47 tensors, experts fused, hashed as SGLang hashes CUDA tensors);
- the server's logprobs of a sampled continuation equal the trainer's on the same tokens (fp32 on
  both GPUs' kernels: mean |delta| < 1e-4), at the new weight version.

Backends: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), so on a
one-GPU machine the weight-update group is gloo with the model on CUDA on both sides (the trainer's
flattened buckets are staged through the host); with two GPUs the server runs on cuda:1 and the
group is NCCL, as on a cluster. CUDA only (auto-skipped elsewhere by tests/conftest.py).
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from parallel.distributed import run_distributed_test

pytestmark = pytest.mark.gpu

PROMPT = [5, 17, 33, 40, 41, 42, 50]


def _batch(tokens: list[int]):
    from sao_megatron.core.records import TrainBatch

    seq = len(tokens)
    zeros = torch.zeros(1, seq)
    return TrainBatch(tokens=torch.tensor([tokens]), lengths=torch.tensor([seq]), loss_mask=zeros.clone(),
                      rollout_logprobs=zeros.clone(), advantages=zeros.clone(), returns=zeros.clone(),
                      weight_versions=torch.zeros(1, seq, dtype=torch.long), global_num_tokens=1.0)


async def sync_and_sample(named, url: str, backend: str):
    """Push `named` to the server at `url`, check every tensor, then sample a continuation of PROMPT."""
    from rollout.engines.engine import GenerateRequest
    from rollout.engines.sglang_client import SGLangEngine
    from rollout.weights.check import check_weight_update_equal
    from rollout.weights import BroadcastWeightSync
    from sao_megatron.core.config import WeightSyncConfig

    engine = SGLangEngine(url, api_key="k", name="ref-cuda", control_timeout_s=60, weight_timeout_s=300)
    try:
        sync = BroadcastWeightSync(WeightSyncConfig(backend=backend, bucket_mb=0.1, timeout_s=300), [engine])
        async with sync.update_session():   # the caller holds the session (and any pause)
            await sync.push(named, version=1)
        checked = [c.compared for c in await check_weight_update_equal([engine], named)]
        result = await engine.generate(GenerateRequest(rid="after-sync", input_ids=PROMPT, max_new_tokens=10,
                                                       temperature=1.0, seed=11, return_routed_experts=False))
        await sync.close()
        return checked, result
    finally:
        await engine.close()


def trainer_pushes(model_dir: str, url: str, backend: str) -> dict:
    """One rank: a step on the tiny MoE, the push, and the trainer's logprobs of what the server sampled."""
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.rl_model import RLModel

    hf = load_file(f"{model_dir}/model.safetensors")
    model = RLModel.build(lc.make_recipe(model_dir, {}, lr=1e-2), "policy")
    model.load_hf_state_dict(hf)
    model.train_step(lc.fixed_batches(105, num=2, seq=12), lc.policy_gradient_loss)
    named = list(model.export_hf())
    changed = max((t.float().cpu() - hf[n].float()).abs().max().item() for n, t in named)
    checked, result = asyncio.run(sync_and_sample(named, url, backend))
    logp = model.compute_logprobs([_batch(PROMPT + result.output_ids)])[0][0][0].cpu()
    return {"device": named[0][1].device.type, "changed": changed, "checked": checked,
            "version": result.weight_version, "served": result.output_logprobs,
            "trainer": logp[len(PROMPT):].tolist(), "n_out": len(result.output_ids)}


def _need_two_gpus(backend: str) -> None:
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the server on its own GPU (NCCL refuses two ranks on one device): 2+ GPUs")


@pytest.fixture(scope="module", params=["gloo", "nccl"])
def outcome(request, tiny_model_dir):
    from rollout.engines.reference_server import launch_local

    backend = request.param
    _need_two_gpus(backend)
    device = "cuda:1" if backend == "nccl" else "cuda:0"
    with launch_local(tiny_model_dir, port=0, api_key="k", timeout_s=300,
                      extra_args=["--device", device, "--dtype", "fp32"]) as server:
        out = run_distributed_test(trainer_pushes, world_size=1, backend="nccl", timeout_s=600,
                                   args=(str(tiny_model_dir), server.url, backend))[0]
        out["server_log"] = server.log_path.read_text(errors="replace")
    out["server_device"] = device
    return out


def test_trained_weights_arrive_bit_exact_on_the_cuda_server(outcome):
    assert outcome["device"] == "cuda" and f"on {outcome['server_device']})" in outcome["server_log"]
    assert outcome["changed"] > 1e-4           # the step moved the weights: the check is not vacuous
    assert outcome["checked"] == [47] and outcome["version"] == 1


def test_cuda_server_logprobs_equal_trainer_logprobs(outcome):
    served, trainer = torch.tensor(outcome["served"]), torch.tensor(outcome["trainer"])
    assert outcome["n_out"] == len(served) == len(trainer) >= 1
    assert (served - trainer).abs().mean().item() < 1e-4
