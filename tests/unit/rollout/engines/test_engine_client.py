"""SGLangEngine against an in-process fake SGLang: reply checks, retries, versions, errors name the engine."""
from __future__ import annotations

import asyncio
import base64
import socket

import numpy as np
import pytest
import torch
from aiohttp import web

from rollout.engines.engine import EngineError, GenerateRequest
from rollout.engines.sglang_client import SGLangEngine, parse_generate_reply

REQ = GenerateRequest(rid="r1", input_ids=[1, 2, 3], max_new_tokens=4)


def b64(array) -> str:
    return base64.b64encode(np.asarray(array, dtype="<i4").tobytes()).decode()


def reply(output_ids=(7, 8), **meta):
    base = {"finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "weight_version": "2",
            "output_token_logprobs": [[-0.5, 7, None], [-1.25, 8, None]],
            "routed_experts": b64(np.arange(4 * 3 * 2) % 8)}
    base.update(meta)
    return {"text": "", "output_ids": list(output_ids), "meta_info": base}


def test_parse_valid_reply_decodes_routes_and_versions():
    res = parse_generate_reply(reply(weight_versions=[{"version": "1", "start": 0, "end": 1},
                                                      {"version": "2", "start": 1, "end": 2}]), REQ, 2, 3, "e0")
    assert res.output_ids == [7, 8] and res.output_logprobs == [-0.5, -1.25]
    assert res.finish_reason == "length" and res.weight_version == 2
    assert res.output_weight_versions == [1, 2]                       # SGLang spans expanded per token
    assert res.routed_experts.dtype == torch.int32 and res.routed_experts.shape == (4, 3, 2)
    assert res.routed_experts.flatten().tolist() == [i % 8 for i in range(24)]
    ours = parse_generate_reply(reply(output_token_weight_versions=[0, 3]), REQ, 2, None, "e0")
    assert ours.output_weight_versions == [0, 3]
    assert parse_generate_reply(reply(weight_version="default"), REQ, 2, None, "e0").weight_version == 0


@pytest.mark.parametrize("bad, needle", [
    ({"meta_info": None}, "'meta_info' missing"),
    ({"output_ids": "78"}, "output_ids"),
    ({"meta_info": {"finish_reason": {"type": "weird"}}}, "finish_reason"),
    ({"meta_info": {"output_token_logprobs": [[-0.5, 7, None]]}}, "1 entries for 2 output tokens"),
    ({"meta_info": {"output_token_logprobs": [[-0.5, 7, None], [float("nan"), 8, None]]}}, "finite"),
    ({"meta_info": {"output_token_logprobs": [[-0.5, 7, None], [-1.0, 9, None]]}}, "does not match output token 8"),
    ({"meta_info": {"routed_experts": b64(np.zeros(5))}}, "not divisible"),
    ({"meta_info": {"routed_experts": None, "drop": "routed_experts"}}, "routed_experts missing"),
    ({"meta_info": {"weight_version": "v7"}}, "not an integer"),
])
def test_malformed_replies_raise(bad, needle):
    data = reply()
    for key, value in bad.items():
        if key == "meta_info" and isinstance(value, dict):
            data["meta_info"].update({k: v for k, v in value.items() if k != "drop"})
            if "drop" in value:
                data["meta_info"].pop(value["drop"])
        else:
            data[key] = value
    with pytest.raises(ValueError, match=needle):
        parse_generate_reply(data, REQ, 2, 3, "e0")


async def _serve(handlers: dict):
    app = web.Application()
    for (method, path), handler in handlers.items():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_engine_errors_name_the_engine_and_route():
    seen_auth = []

    async def generate(request):
        seen_auth.append(request.headers.get("Authorization"))
        body = await request.json()
        if body["rid"] == "bad-json":
            return web.json_response({"output_ids": [1]})
        return web.json_response({"error": {"message": "input is too long"}}, status=400)

    async def update(request):
        return web.json_response({"success": False, "message": "shape mismatch"}, status=400)

    async def slow(request):
        await asyncio.sleep(5)
        return web.Response()

    async def main():
        runner, url = await _serve({("POST", "/generate"): generate, ("POST", "/update_weights_from_disk"): update,
                                    ("POST", "/pause_generation"): slow})
        engine = SGLangEngine(url, api_key="k", name="eng7", control_timeout_s=0.2)
        errors = []
        for call in (lambda: engine.generate(REQ),
                     lambda: engine.generate(GenerateRequest(rid="bad-json", input_ids=[1], max_new_tokens=1)),
                     lambda: engine.update_weights_from_disk("/m", 3),
                     lambda: engine.pause("abort")):
            with pytest.raises(EngineError) as info:
                await call()
            errors.append(str(info.value))
        await engine.close()
        await runner.cleanup()
        return errors

    errors = asyncio.run(main())
    assert errors[0] == "engine eng7: /generate answered HTTP 400: input is too long"
    assert errors[1].startswith("engine eng7: /generate reply for rid bad-json: 'meta_info' missing")
    assert errors[2] == "engine eng7: /update_weights_from_disk failed: shape mismatch"
    assert errors[3] == "engine eng7: /pause_generation timed out after 0s"
    assert seen_auth == ["Bearer k", "Bearer k"]


def test_connection_errors_are_retried_with_backoff_then_reported():
    with socket.socket() as sock:   # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sleeps = []

    async def main():
        engine = SGLangEngine(f"http://127.0.0.1:{port}", name="gone", max_retries=3, backoff_s=0.01)
        real_sleep = asyncio.sleep

        async def record(delay):
            sleeps.append(delay)
            await real_sleep(0)
        asyncio.sleep = record
        try:
            with pytest.raises(EngineError, match="engine gone: /flush_cache failed after 4 connection attempts"):
                await engine.flush_cache()
            healthy = await engine.health()
        finally:
            asyncio.sleep = real_sleep
            await engine.close()
        return healthy

    assert asyncio.run(main()) is False
    assert sleeps[:3] == [0.01, 0.02, 0.04]


def test_retry_succeeds_when_server_comes_up():
    calls = []

    async def main():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        engine = SGLangEngine(f"http://127.0.0.1:{port}", name="late", max_retries=5, backoff_s=0.05)

        async def info(request):
            calls.append(1)
            return web.json_response({"weight_version": "11"})
        app = web.Application()
        app.router.add_get("/model_info", info)
        runner = web.AppRunner(app)
        await runner.setup()

        async def start_later():
            await asyncio.sleep(0.06)   # after the first attempt failed
            await web.TCPSite(runner, "127.0.0.1", port).start()
        starter = asyncio.create_task(start_later())
        version = await engine.weight_version()
        await starter
        await engine.close()
        await runner.cleanup()
        return version

    assert asyncio.run(main()) == 11 and calls == [1]


def test_route_shape_comes_from_config_json(tiny_model_dir, tmp_path):
    from rollout.engines.routed_experts import route_shape_from_config

    assert route_shape_from_config(tiny_model_dir) == {"moe_topk": 2, "num_layers": 4}
    (tmp_path / "config.json").write_text('{"text_config": {"num_hidden_layers": 3}}')   # dense
    assert route_shape_from_config(tmp_path) == {"moe_topk": None, "num_layers": None}
    with pytest.raises(ValueError, match=r"missing/config.json.*fix: point model.path"):
        route_shape_from_config(tmp_path / "missing")


def test_session_routes_namespace_and_routes_without_topk():
    """begin/end_weight_update bodies; extra_key sent only with a namespace; routes in a reply with no
    moe_topk fail naming the fix (SGLang never reports it) instead of asking /model_info."""
    bodies = []

    async def record(request):
        bodies.append((request.path, await request.json()))
        return web.json_response({"success": True, "message": "Success"})

    async def generate(request):
        bodies.append((request.path, await request.json()))
        return web.json_response(reply())

    async def main():
        runner, url = await _serve({("POST", "/begin_weight_update"): record, ("POST", "/end_weight_update"): record,
                                    ("POST", "/generate"): generate})
        engine = SGLangEngine(url, name="e9")
        await engine.begin_weight_update()
        await engine.end_weight_update()
        with pytest.raises(EngineError, match="engine e9: cannot decode routed experts: moe_topk unknown"):
            await engine.generate(REQ)
        engine.moe_topk, engine.num_layers, engine.cache_namespace = 2, 3, "sao-w2"
        result = await engine.generate(REQ)
        await engine.close()
        await runner.cleanup()
        return result

    result = asyncio.run(main())
    assert bodies[:2] == [("/begin_weight_update", {"selector": "all"}), ("/end_weight_update", {})]
    assert "extra_key" not in bodies[2][1] and bodies[3][1]["extra_key"] == "sao-w2"
    assert result.routed_experts.shape == (4, 3, 2)
