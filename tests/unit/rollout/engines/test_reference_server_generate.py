"""Generation through the SGLang client against the reference server (one server for the module).

Checks: logprobs equal a teacher-forced HF forward at the sampling temperature (1e-5, fp32) with
top-p/top-k active; routed experts equal the routes a teacher-forced forward records; 32 concurrent
requests come back unmixed; abort mid-generation frees the slot; bad requests get 4xx.
"""
from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
import torch
from reference_http import scheduler_state, wait_for

from rollout.engines.engine import EngineError, GenerateRequest
from rollout.engines.reference_server import launch_local
from rollout.engines.sglang_client import SGLangEngine, generate_body, parse_generate_reply

KEY = "test-key"
MAX_CONTEXT = 256


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    handle = launch_local(tiny_model_dir, api_key=KEY, timeout_s=300, seed=7,
                          extra_args=["--max-context", str(MAX_CONTEXT), "--max-batch", "40"])
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def teacher(tiny_model_dir):
    """Plain HF model with its own router hooks: (logits [T, V], routes [T, layers, topk]) per sequence."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    captured = {}
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    for i, router in enumerate(routers):
        router.register_forward_hook(lambda mod, inp, out, i=i: captured.__setitem__(i, out[2]))

    def forward(tokens: list[int]):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
        routes = torch.stack([captured[i] for i in range(len(routers))], dim=1).to(torch.int32)
        return logits, routes
    return forward


def run(coro_fn, server):
    async def main():
        engine = SGLangEngine(server.url, api_key=KEY, name="ref0", moe_topk=2)
        try:
            return await coro_fn(engine)
        finally:
            await engine.close()
    return asyncio.run(main())


def expected_logprobs(teacher, prompt, output, temperature):
    logits, _ = teacher(prompt + output)
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(output)], logits


def test_logprobs_and_routes_equal_teacher_forced(server, teacher):
    cases = [dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=5), dict(temperature=1.3),
             dict(temperature=1.0, top_p=0.5, top_k=20)]
    rng = random.Random(0)
    requests = [GenerateRequest(rid=f"tf{i}", input_ids=[rng.randrange(7, 100) for _ in range(5 + 7 * i)],
                                max_new_tokens=12, seed=100 + i, **case) for i, case in enumerate(cases)]
    results = run(lambda e: asyncio.gather(*(e.generate(r) for r in requests)), server)
    for req, res in zip(requests, results):
        want, logits = expected_logprobs(teacher, req.input_ids, res.output_ids, req.temperature)
        assert max(abs(a - b) for a, b in zip(want, res.output_logprobs)) < 1e-5, req.rid
        for t, tok in enumerate(res.output_ids):   # truncation acted on sampling, not on the logprob
            if req.top_k > 0:
                assert tok in torch.topk(logits[len(req.input_ids) - 1 + t], req.top_k).indices.tolist()
        _, routes = teacher(req.input_ids + res.output_ids)
        n_fed = len(req.input_ids) + len(res.output_ids) - 1
        assert res.routed_experts.shape == (n_fed, 4, 2)
        assert torch.equal(res.routed_experts, routes[:n_fed]), req.rid
        assert res.output_weight_versions == [0] * len(res.output_ids)
        assert res.weight_version == 0 and res.prompt_tokens == len(req.input_ids)


def test_32_concurrent_requests_are_not_mixed(server, teacher):
    rng = random.Random(1)
    requests = [GenerateRequest(rid=f"c{i}", input_ids=[rng.randrange(7, 100) for _ in range(rng.randrange(3, 60))],
                                max_new_tokens=rng.randrange(4, 30), temperature=1.0, seed=i,
                                return_routed_experts=(i % 2 == 0)) for i in range(32)]
    for req in requests:
        req.stop_token_ids = []
    results = run(lambda e: asyncio.gather(*(e.generate(r) for r in requests)), server)
    for req, res in zip(requests, results):
        assert res.rid == req.rid and res.prompt_tokens == len(req.input_ids)
        assert 1 <= len(res.output_ids) <= req.max_new_tokens
        want, _ = expected_logprobs(teacher, req.input_ids, res.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(want, res.output_logprobs)) < 1e-5, req.rid
        assert (res.routed_experts is not None) == req.return_routed_experts
    alone = run(lambda e: asyncio.gather(*(e.generate(requests[i]) for i in (0, 13, 31))), server)
    for i, res in zip((0, 13, 31), alone):   # seeded: the same tokens batched with 31 others or not
        assert res.output_ids == results[i].output_ids


async def long_generate(engine, req: GenerateRequest):
    """/generate with ignore_eos (not in the Engine request type) so the request surely runs long."""
    body = generate_body(req)
    body["sampling_params"]["ignore_eos"] = True
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
        async with session.post(engine.url + "/generate", json=body) as reply:
            assert reply.status == 200, await reply.text()
            return parse_generate_reply(await reply.json(), req, 2, 4, engine.name)


def test_abort_mid_generation_returns_abort_and_frees_slot(server):
    long = GenerateRequest(rid="long", input_ids=[10, 11, 12], max_new_tokens=MAX_CONTEXT - 10, seed=3)

    async def scenario(engine):
        task = asyncio.create_task(long_generate(engine, long))
        await wait_for(engine.url, KEY, lambda s: s["running_output_tokens"] >= 3, task)
        await engine.abort("long")
        result = await task
        info = await scheduler_state(engine.url, KEY)
        after = await engine.generate(GenerateRequest(rid="after", input_ids=[5, 6], max_new_tokens=4))
        return result, info, after

    result, info, after = run(scenario, server)
    assert result.finish_reason == "abort"
    assert 3 <= len(result.output_ids) < long.max_new_tokens
    assert len(result.output_logprobs) == len(result.output_ids)
    assert result.routed_experts.shape[0] == 3 + len(result.output_ids) - 1
    assert info["running"] == 0 and info["waiting"] == 0
    assert after.finish_reason in ("length", "stop") and len(after.output_ids) >= 1


def test_bad_requests_get_4xx_and_server_stays_up(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    good = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    cases = [
        (b"{not json", auth, 400, "not valid JSON"),
        (json.dumps({**good, "sampling_params": {"temperature": "hot"}}), auth, 400, "temperature"),
        (json.dumps({**good, "input_ids": [1, "x"]}), auth, 400, "input_ids"),
        (json.dumps({**good, "frobnicate": 1}), auth, 400, "frobnicate"),
        (json.dumps({**good, "input_ids": [5] * (MAX_CONTEXT + 1)}), auth, 400, "longer than the model's context length"),
        (json.dumps({**good, "input_ids": [5, 10_000]}), auth, 400, "vocabulary"),
        (json.dumps({**good, "sampling_params": {"top_p": 0}}), auth, 400, "top_p"),
        (json.dumps(good), {}, 401, "API key"),
        (json.dumps(good), {"Authorization": "Bearer wrong"}, 401, "API key"),
    ]

    async def scenario(engine):
        replies = []
        async with aiohttp.ClientSession() as session:
            for body, headers, _, _ in cases:
                async with session.post(server.url + "/generate", data=body,
                                        headers={**headers, "Content-Type": "application/json"}) as reply:
                    replies.append((reply.status, await reply.text()))
        with pytest.raises(EngineError, match="ref0.*HTTP 400.*max_new_tokens"):
            await engine.generate(GenerateRequest(rid="bad", input_ids=[5], max_new_tokens=0))
        healthy = await engine.health()
        ok = await engine.generate(GenerateRequest(rid="ok", input_ids=[5, 6], max_new_tokens=3))
        return replies, healthy, ok

    replies, healthy, ok = run(scenario, server)
    for (_, _, status, needle), (got_status, text) in zip(cases, replies):
        assert got_status == status, text
        assert needle in json.loads(text)["error"]["message"]
    assert healthy and len(ok.output_ids) >= 1
