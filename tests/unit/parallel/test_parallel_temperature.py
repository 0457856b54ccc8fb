"""The trainer's policy is the engine's sampling distribution softmax(logits / T).

SGLang 0.5.23 (layers/sampler.py: logits.div_(temperatures), then log of the softmax, no top-p/top-k
truncation) and the reference server report log_softmax(logits / T); the trainer's logprobs, old
logprobs and entropy must use the same T or the on-policy ratio is not 1.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from parallel.distributed import run_distributed_test
from parallel.logprobs import tempered, token_logprobs_from_logits

PROMPT = [5, 17, 33, 40, 41, 42, 50]
T = 0.7


def _reference(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    logsm = torch.log_softmax(logits / temperature, dim=-1)
    logp = logsm[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)[:, :-1]
    return logp, ent


def test_logprobs_and_entropy_are_those_of_the_tempered_distribution():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 13, generator=gen) * 3
    tokens = torch.randint(0, 13, (2, 9), generator=gen)
    logp, ent = token_logprobs_from_logits(logits, tokens, 13, temperature=T)
    ref_logp, ref_ent = _reference(logits, tokens, T)
    assert torch.allclose(logp[:, 1:], ref_logp, atol=1e-6) and torch.allclose(ent[:, 1:], ref_ent, atol=1e-6)
    assert float(logp[:, 0].abs().max()) == 0.0 and float(ent[:, 0].abs().max()) == 0.0
    untempered, _ = _reference(logits, tokens, 1.0)
    assert float((ref_logp - untempered).abs().mean()) > 0.05   # the check above tells T = 0.7 from T = 1


def test_gradient_carries_the_temperature():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(1, 6, 11, generator=gen) * 2).requires_grad_(True)
    tokens = torch.randint(0, 11, (1, 6), generator=gen)
    logp, ent = token_logprobs_from_logits(logits, tokens, 11, temperature=T)
    (logp.sum() + 0.1 * ent.sum()).backward()
    ref_in = logits.detach().clone().requires_grad_(True)
    ref_logp, ref_ent = _reference(ref_in, tokens, T)
    (ref_logp.sum() + 0.1 * ref_ent.sum()).backward()
    assert torch.allclose(logits.grad, ref_in.grad, atol=1e-6)


def test_temperature_one_is_untouched_and_nonpositive_is_refused():
    logits = torch.randn(2, 3)
    assert tempered(logits, 1.0) is logits
    with pytest.raises(ValueError, match="rollout.temperature"):
        tempered(logits, 0.0)


async def _sample(url: str, api_key: str):
    from rollout.engines.engine import GenerateRequest
    from rollout.engines.sglang_client import SGLangEngine

    engine = SGLangEngine(url, api_key=api_key, name="ref-0")
    try:   # top-p/top-k narrow the sampling but not the reported logprobs
        return await engine.generate(GenerateRequest(rid="t07", input_ids=PROMPT, max_new_tokens=12, temperature=T,
                                                     top_p=0.9, top_k=20, seed=3, return_routed_experts=False))
    finally:
        await engine.close()


def _trainer_logprobs(model_dir: str, tokens: list[int]) -> dict:
    from dataclasses import replace

    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.rl_model import RLModel
    from sao_megatron.core.records import TrainBatch

    recipe = lc.make_recipe(model_dir, {})
    recipe.rollout = replace(recipe.rollout, temperature=T)
    model = RLModel.build(recipe, "policy")
    model.load_hf_state_dict(load_file(f"{model_dir}/model.safetensors"))
    zeros = torch.zeros(1, len(tokens))
    batch = TrainBatch(tokens=torch.tensor([tokens]), lengths=torch.tensor([len(tokens)]), loss_mask=zeros,
                       rollout_logprobs=zeros, advantages=zeros, returns=zeros,
                       weight_versions=torch.zeros(1, len(tokens), dtype=torch.long), global_num_tokens=1.0)
    at_t = model.compute_logprobs([batch])[0][0][0]
    model.temperature = 1.0    # what the trainer computed before it read rollout.temperature
    at_one = model.compute_logprobs([batch])[0][0][0]
    return {"at_t": at_t[len(PROMPT):], "at_one": at_one[len(PROMPT):]}


@pytest.fixture(scope="module")
def engine_and_trainer(tiny_model_dir):
    from rollout.engines.reference_server import launch_local

    with launch_local(tiny_model_dir, port=0, api_key="k", timeout_s=300) as server:
        result = asyncio.run(_sample(server.url, "k"))
    out = run_distributed_test(_trainer_logprobs, world_size=1, timeout_s=600,
                               args=(str(tiny_model_dir), PROMPT + result.output_ids))[0]
    return torch.tensor(result.output_logprobs), out


def test_trainer_logprobs_equal_engine_logprobs_at_temperature(engine_and_trainer):
    served, trainer = engine_and_trainer
    assert served.shape == trainer["at_t"].shape and served.numel() == 12
    assert float((served - trainer["at_t"]).abs().max()) < 1e-5


def test_untempered_logprobs_would_miss_the_engine(engine_and_trainer):
    served, trainer = engine_and_trainer
    assert float((served - trainer["at_one"]).abs().mean()) > 1e-2
