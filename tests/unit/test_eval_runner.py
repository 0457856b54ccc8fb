"""Evaluation against the reference server: k samples per problem, scores in range, deterministic by seed."""
from __future__ import annotations

import asyncio

import pytest

from sao_megatron.core.config import EvalConfig, RolloutConfig


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from rollout.reference_server import launch_local

    server = launch_local(tiny_model_dir, api_key="k", seed=0)
    yield server
    server.stop()


def _evaluate(server, tiny_model_dir, seed):
    from transformers import AutoTokenizer

    from rollout.sglang_client import SGLangEngine
    from sao_megatron.evaluation.runner import evaluate_all

    async def go():
        client = SGLangEngine(server.url, api_key="k", name="eval")
        try:
            return await evaluate_all([client], AutoTokenizer.from_pretrained(tiny_model_dir),
                                      EvalConfig(datasets=["task:arithmetic"], k=4, max_problems=6),
                                      RolloutConfig(max_new_tokens=4), seed=seed)
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
