"""The whole weight path from the Megatron trainer: RLModel (CPU/gloo) takes an optimizer step,
export_hf() streams HF tensors, BroadcastWeightSync sends them to the reference server over its own
gloo group (Megatron's default group stays in use in the same process), and then
- every server tensor equals the trainer's bit for bit (check_weight_update_equal: the 135 HF tensors
  hashed as the server's 47, experts fused),
- the server's logprobs of a sampled continuation equal the trainer's on the same tokens
  (mean |delta| < 1e-5, fp32), with the server reporting the new weight version.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from parallel.distributed import run_distributed_test

PROMPT = [5, 17, 33, 40, 41, 42, 50]


def _batch(tokens: list[int]):
    from sao_megatron.core.records import TrainBatch

    seq = len(tokens)
    zeros = torch.zeros(1, seq)
    return TrainBatch(tokens=torch.tensor([tokens]), lengths=torch.tensor([seq]), loss_mask=zeros.clone(),
                      rollout_logprobs=zeros.clone(), advantages=zeros.clone(), returns=zeros.clone(),
                      weight_versions=torch.zeros(1, seq, dtype=torch.long), global_num_tokens=1.0)


async def _sync_and_sample(named, url: str, api_key: str):
    from rollout.engines.engine import GenerateRequest
    from rollout.engines.sglang_client import SGLangEngine
    from rollout.weights.check import check_weight_update_equal
    from rollout.weights import BroadcastWeightSync
    from sao_megatron.core.config import WeightSyncConfig

    engine = SGLangEngine(url, api_key=api_key, name="ref-0", control_timeout_s=60, weight_timeout_s=120)
    try:
        sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=0.1, timeout_s=120), [engine])
        async with sync.update_session():   # the caller holds the session (and any pause)
            await sync.push(named, version=1)
        checked = [c.compared for c in await check_weight_update_equal([engine], named)]
        result = await engine.generate(GenerateRequest(rid="after-sync", input_ids=PROMPT, max_new_tokens=10,
                                                       temperature=1.0, seed=11, return_routed_experts=False))
        await sync.close()
        return checked, result
    finally:
        await engine.close()


def _trainer(model_dir: str, url: str, api_key: str) -> dict:
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.rl_model import RLModel

    hf = load_file(f"{model_dir}/model.safetensors")
    model = RLModel.build(lc.make_recipe(model_dir, {}, lr=1e-2), "policy")
    model.load_hf_state_dict(hf)
    model.train_step(lc.fixed_batches(105, num=2, seq=12), lc.policy_gradient_loss)
    named = list(model.export_hf())
    changed = max((t.float() - hf[n].float()).abs().max().item() for n, t in named)
    checked, result = asyncio.run(_sync_and_sample(named, url, api_key))
    logp = model.compute_logprobs([_batch(PROMPT + result.output_ids)])[0][0][0]
    return {"changed": changed, "checked": checked, "version": result.weight_version,
            "served": result.output_logprobs, "trainer": logp[len(PROMPT):].tolist(), "n_out": len(result.output_ids)}


@pytest.fixture(scope="module")
def outcome(tiny_model_dir):
    from rollout.engines.reference_server import launch_local

    with launch_local(tiny_model_dir, port=0, api_key="k", timeout_s=300) as server:
        return run_distributed_test(_trainer, world_size=1, timeout_s=600, args=(str(tiny_model_dir), server.url, "k"))[0]


def test_trained_weights_arrive_bit_exact(outcome):
    assert outcome["changed"] > 1e-4          # the step moved the weights, so the check is not vacuous
    assert outcome["checked"] == [47] and outcome["version"] == 1


def test_served_logprobs_equal_trainer_logprobs(outcome):
    served, trainer = torch.tensor(outcome["served"]), torch.tensor(outcome["trainer"])
    assert outcome["n_out"] == 10 and served.shape == trainer.shape
    assert (served - trainer).abs().mean().item() < 1e-5
