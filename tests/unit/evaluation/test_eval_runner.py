"""Evaluation against the reference server: k samples per problem, scores in range, deterministic by seed."""
from __future__ import annotations

import asyncio

import pytest

from sao_megatron.core.config import EvalConfig, RolloutConfig


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from rollout.engines.reference_server import launch_local

    server = launch_local(tiny_model_dir, api_key="k", seed=0)
    yield server
    server.stop()


def _evaluate(server, tiny_model_dir, seed, max_new_tokens=4, context_length=None, k=4, problems=6):
    from transformers import AutoTokenizer

    from rollout.engines.sglang_client import SGLangEngine
    from sao_megatron.evaluation.runner import evaluate_all

    async def go():
        client = SGLangEngine(server.url, api_key="k", name="eval")
        try:
            return await evaluate_all([client], AutoTokenizer.from_pretrained(tiny_model_dir),
                                      EvalConfig(datasets=["task:arithmetic"], k=k, max_problems=problems),
                                      RolloutConfig(max_new_tokens=max_new_tokens), seed=seed,
                                      context_length=context_length)
        finally:
            await client.close()

    return asyncio.run(go())


def test_eval_reports_avg_and_pass_at_k(engine, tiny_model_dir):
    first = _evaluate(engine, tiny_model_dir, seed=3)
    assert first["eval/arithmetic/problems"] == 6
    assert 0.0 <= first["eval/arithmetic/avg@4"] <= 1.0
    assert first["eval/arithmetic/pass@1"] <= first["eval/arithmetic/pass@4"] <= 1.0
    # seeded sampling: the same seed gives the same numbers
    assert _evaluate(engine, tiny_model_dir, seed=3) == first


def test_eval_caps_max_new_tokens_to_the_context_and_scores_a_prompt_that_does_not_fit_zero(engine, tiny_model_dir):
    """The server (context 256, the tiny model's) refuses prompt + max_new_tokens past 256 as SGLang
    does; the eval caps each request to fit instead. A prompt that alone does not fit is never sent:
    it scores 0 and is counted in `errors`."""
    # 2 problems x 1 sample: each runs to the context's end (a random model), ~240 tokens apiece
    capped = _evaluate(engine, tiny_model_dir, seed=3, max_new_tokens=300, context_length=256, k=1, problems=2)
    assert capped["eval/arithmetic/problems"] == 2 and "eval/arithmetic/errors" not in capped
    tight = _evaluate(engine, tiny_model_dir, seed=3, context_length=5)
    assert tight["eval/arithmetic/errors"] == 24 and tight["eval/arithmetic/pass@4"] == 0.0
