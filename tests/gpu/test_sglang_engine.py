"""A real SGLang server started by our launcher, driven by our client (GPU + SGLang only).

Skipped here: SGLang cannot start without CUDA (docs/engines.md). On a GPU node with the `gpu` extra:
`pytest tests/gpu/test_sglang_engine.py`.
"""
from __future__ import annotations

import asyncio
import math

import pytest

pytest.importorskip("sglang", reason="needs SGLang: pip install 'sao-megatron[gpu]' on a CUDA machine")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from rollout.sglang_launcher import launch_sglang
    from sao_megatron.config import load_recipe

    recipe = load_recipe(None, [f"model.path='{tiny_model_dir}'", "rollout.engine='sglang'", "rollout.mem_fraction=0.3"])
    handle = launch_sglang(recipe, index=0, port=0, api_key="k",
                           log_path=tmp_path_factory.mktemp("sglang") / "engine.log", timeout_s=900)
    yield handle
    handle.stop()


def test_generate_returns_logprobs_routes_and_version(server):
    from rollout.engine import GenerateRequest
    from rollout.sglang_client import SGLangEngine

    async def go():
        engine = SGLangEngine(server.url, api_key="k", name="sglang0", moe_topk=2)
        try:
            prompt = [1, 37, 35, 21, 34, 102]
            result = await engine.generate(GenerateRequest(rid="g0", input_ids=prompt, max_new_tokens=8, seed=0))
            return result, await engine.weight_version()
        finally:
            await engine.close()

    result, version = asyncio.run(go())
    assert len(result.output_ids) == len(result.output_logprobs) >= 1
    assert all(math.isfinite(lp) and lp <= 0 for lp in result.output_logprobs)
    assert result.routed_experts is not None
    assert tuple(result.routed_experts.shape) == (6 + len(result.output_ids) - 1, 4, 2)
    assert version == result.weight_version
