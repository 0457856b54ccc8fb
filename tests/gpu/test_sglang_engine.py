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
    from rollout.engines.sglang_launcher import launch_sglang
    from sao_megatron.core.config import load_recipe

    recipe = load_recipe(None, [f"model.path='{tiny_model_dir}'", "rollout.engine='sglang'", "rollout.mem_fraction=0.3"])
    handle = launch_sglang(recipe, index=0, port=0, api_key="k",
                           log_path=tmp_path_factory.mktemp("sglang") / "engine.log", timeout_s=900)
    yield handle
    handle.stop()


def _client(server, tiny_model_dir):
    """The client as the trainer builds it (engines.engine_clients: routes' shape from config.json)."""
    from sao_megatron.core.config import load_recipe
    from sao_megatron.trainer.engines import engine_clients

    recipe = load_recipe(None, [f"model.path='{tiny_model_dir}'", "rollout.engine='sglang'"])
    return engine_clients(recipe, [server.url], "k")[0]


def test_generate_returns_logprobs_routes_and_version(server, tiny_model_dir):
    from rollout.engines.engine import GenerateRequest

    async def go():
        engine = _client(server, tiny_model_dir)
        try:
            prompt = [1, 37, 35, 21, 34, 102]
            engine.cache_namespace = "sao-w0"      # SGLang accepts the prefix-cache namespace (extra_key)
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


def test_distributed_update_refused_outside_a_session_and_disk_update_while_paused_in_place(server, tiny_model_dir):
    """SGLang 0.5.23: update_weights_from_distributed outside begin/end_weight_update answers 400 at
    once (no group needed to see it); a disk update with flush_cache=False loads while a request is
    paused in place, and the reachable() probe (/model_info) answers while paused."""
    from rollout.engines.engine import EngineError, GenerateRequest

    async def go():
        engine = _client(server, tiny_model_dir)
        try:
            with pytest.raises(EngineError, match="begin_weight_update"):
                await engine.update_weights_from_distributed(["model.norm.weight"], ["bfloat16"], [[64]], "none", 1)
            await engine.begin_weight_update()
            await engine.end_weight_update()
            running = asyncio.create_task(engine.generate(GenerateRequest(rid="long", input_ids=[1, 2, 3],
                                                                          max_new_tokens=400, seed=1)))
            await asyncio.sleep(0.5)
            await engine.pause("in_place")
            reachable = await engine.reachable()
            await engine.update_weights_from_disk(str(tiny_model_dir), 3, flush_cache=False)
            await engine.resume()
            result = await running
            return reachable, await engine.weight_version(), result
        finally:
            await engine.close()

    reachable, version, result = asyncio.run(go())
    assert reachable and version == 3 and result.weight_version == 3 and len(result.output_ids) >= 1
