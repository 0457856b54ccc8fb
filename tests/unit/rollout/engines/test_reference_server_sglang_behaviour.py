"""The reference server does what SGLang 0.5.23 does where the trainer depends on it (each behaviour
is pinned in SGLang's own source by test_sglang_behaviour_contract.py):

weight-update sessions, /health generating through the pause gate, /model_info's exact keys, flush
refused unless idle (also after an update with flush_cache), unpaused updates waiting for in-flight
requests, routes on every hidden layer (GLM-4.5 class: first layer dense), `--tp 2` joining the
weight-update group as two ranks, and Starting -> 503 before the warmup.
"""
from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch
import torch.distributed as dist
from reference_http import call, post, scheduler_state, wait_for
from safetensors.torch import load_file
from sglang_wheel import model_info_keys

from rollout.engines.engine import GenerateRequest
from rollout.engines.reference_server import launch_local
from rollout.engines.reference_server.weight_group import flatten_bucket, init_weight_update_group
from rollout.engines.reference_server.weight_updates import NO_SESSION, NO_SESSION_TO_END, NOT_FLUSHED, SESSION_OPEN
from rollout.engines.sglang_client import SGLangEngine, generate_body
from sao_megatron.core.ports import free_port

KEY = "beh-key"
PROMPT = [10, 11, 12, 13]
HEALTH_TIMEOUT_S = 2


def _launch(model_dir, *args, env=None):
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        return launch_local(model_dir, api_key=KEY, timeout_s=300,
                            extra_args=["--max-context", "512", "--weight-sync-timeout-s", "60", *args])
    finally:
        os.environ.clear()
        os.environ.update(old)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    handle = _launch(tiny_model_dir, env={"SGLANG_HEALTH_CHECK_TIMEOUT": str(HEALTH_TIMEOUT_S)})
    yield handle
    handle.stop()


def run(coro):
    return asyncio.run(coro)


async def long_generate(url: str, rid: str, max_new_tokens: int) -> dict:
    body = generate_body(GenerateRequest(rid=rid, input_ids=PROMPT, max_new_tokens=max_new_tokens, seed=1))
    body["sampling_params"]["ignore_eos"] = True
    status, reply = await post(url, KEY, "/generate", body)
    assert status == 200, reply
    return reply


def versions(reply: dict) -> list[int]:
    return reply["meta_info"]["output_token_weight_versions"]


def test_model_info_has_exactly_sglangs_keys(server):
    status, info = run(call(server.url, KEY, "GET", "/model_info"))
    assert status == 200 and set(info) == model_info_keys()
    assert info["weight_version"] == "0" and info["model_type"] == "qwen3_moe"
    status, ours = run(call(server.url, KEY, "GET", "/sao_server_info"))
    assert (ours["moe_topk"], ours["num_layers"], ours["tp"], ours["status"]) == (2, 4, 1, "Up")


def test_sessions_gate_distributed_updates_and_a_refusal_receives_nothing(server, tiny_model_dir):
    norm = load_file(str(tiny_model_dir / "model.safetensors"))["model.norm.weight"]
    new = torch.randn(norm.shape, generator=torch.Generator().manual_seed(3))
    port, name, box = free_port(), "session_group", {}
    meta = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [list(norm.shape)], "group_name": name}
    broadcast = threading.Event()

    def sender():   # rank 0: one broadcast only, after the refused call
        box["group"] = init_weight_update_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=60)
        broadcast.wait(120)
        dist.broadcast(new.clone(), src=0, group=box["group"])

    async def scenario():
        thread = threading.Thread(target=sender)
        thread.start()
        joined = await post(server.url, KEY, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": name, "backend": "gloo"})
        out = {"joined": joined, "refused": await post(server.url, KEY, "/update_weights_from_distributed", meta),
               "end_none": await post(server.url, KEY, "/end_weight_update"),
               "begin": await post(server.url, KEY, "/begin_weight_update", {"selector": "all"}),
               "begin_again": await post(server.url, KEY, "/begin_weight_update"),
               "bad_selector": await post(server.url, KEY, "/begin_weight_update", {"selector": "both"})}
        out["info"] = await call(server.url, KEY, "GET", "/sao_server_info")
        broadcast.set()   # if the refused call had started a receive, it would now take this broadcast
        out["update"] = await post(server.url, KEY, "/update_weights_from_distributed", {**meta, "weight_version": "4"})
        await asyncio.to_thread(thread.join, 120)
        out["end"] = await post(server.url, KEY, "/end_weight_update")
        out["disk"] = await post(server.url, KEY, "/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
        engine = SGLangEngine(server.url, api_key=KEY)
        out["weight"] = await engine.get_weights_by_name("model.norm.weight")
        await engine.close()
        await post(server.url, KEY, "/destroy_weights_update_group", {"group_name": name})
        return out

    out = run(scenario())
    dist.destroy_process_group(box["group"])
    assert out["joined"] == (200, {"success": True, "message": "Succeeded to initialize custom process group."})
    assert out["refused"] == (400, {"success": False, "message": NO_SESSION})
    assert out["end_none"] == (400, {"success": False, "message": NO_SESSION_TO_END})
    assert out["begin"] == (200, {"success": True, "message": "Success"})
    assert out["begin_again"] == (400, {"success": False, "message": SESSION_OPEN})
    assert out["bad_selector"][0] == 400 and "selector" in out["bad_selector"][1]["error"]["message"]
    assert out["info"][1]["weight_update_session"] == "all"
    assert out["update"] == (200, {"success": True, "message": "Succeeded to update parameter online. "
                                                              "Weight version updated to 4."})
    assert out["end"][0] == 200 and out["disk"][0] == 200          # disk updates need no session
    assert torch.equal(out["weight"], norm)                       # the disk update restored it


def test_health_generates_through_the_pause_gate(server):
    async def scenario():
        out = {"idle": [(await call(server.url, "", "GET", p))[0] for p in ("/health", "/health_generate")]}
        await post(server.url, KEY, "/pause_generation", {"mode": "in_place"})
        out["paused"] = [(await call(server.url, "", "GET", p))[0] for p in ("/health", "/health_generate")]
        out["status_paused"] = (await call(server.url, KEY, "GET", "/sao_server_info"))[1]["status"]
        await post(server.url, KEY, "/continue_generation")
        out["resumed"] = (await call(server.url, "", "GET", "/health"))[0]
        out["status_resumed"] = (await call(server.url, KEY, "GET", "/sao_server_info"))[1]["status"]
        busy = asyncio.create_task(long_generate(server.url, "busy", 300))
        before = await wait_for(server.url, KEY, lambda s: s["running_output_tokens"] >= 2, busy)
        out["busy"] = (await call(server.url, "", "GET", "/health"))[0]
        after = await scheduler_state(server.url, KEY)
        await post(server.url, KEY, "/abort_request", {"rid": "busy"})
        await busy
        out["skipped"] = after["health_checks_skipped"] - before["health_checks_skipped"]
        return out

    out = run(scenario())
    assert out["idle"] == [200, 200] and out["paused"] == [503, 503] and out["status_paused"] == "UnHealthy"
    assert out["resumed"] == 200 and out["status_resumed"] == "Up"
    assert out["busy"] == 200 and out["skipped"] == 1            # busy: the probe was not run, a step answered


def test_flush_is_refused_unless_idle_and_after_an_update_that_asks_for_it(server, tiny_model_dir):
    async def scenario():
        out = {"idle": await post(server.url, KEY, "/flush_cache", None)}
        v0 = int((await call(server.url, KEY, "GET", "/model_info"))[1]["weight_version"])
        task = asyncio.create_task(long_generate(server.url, "inplace", 120))
        await wait_for(server.url, KEY, lambda s: s["running_output_tokens"] >= 3, task)
        out["busy"] = await post(server.url, KEY, "/flush_cache", None)
        await post(server.url, KEY, "/pause_generation", {"mode": "in_place"})
        out["in_place"] = await post(server.url, KEY, "/flush_cache", None)
        out["timeout"] = await call(server.url, KEY, "POST", "/flush_cache?timeout=0.3")
        out["disk"] = await post(server.url, KEY, "/update_weights_from_disk",
                                 {"model_path": str(tiny_model_dir), "weight_version": str(v0 + 1)})
        await post(server.url, KEY, "/pause_generation", {"mode": "retract"})
        out["retract"] = await post(server.url, KEY, "/flush_cache", None)
        await post(server.url, KEY, "/continue_generation")
        out["reply"] = await task
        return out, v0

    out, v0 = run(scenario())
    assert out["idle"][0] == 200 and out["idle"][1].startswith("Cache flushed.")
    assert out["busy"] == (400, "Flush cache failed.\n") and out["in_place"] == (400, "Flush cache failed.\n")
    assert out["timeout"] == (400, "Timed out waiting for idle state.")
    assert out["disk"] == (400, {"success": False, "message": NOT_FLUSHED, "num_paused_requests": 0})
    assert out["retract"][0] == 200                                # retracted requests wait in the queue
    tokens = versions(out["reply"])                                # ...but the weights WERE updated
    k = tokens.index(v0 + 1)
    assert len(tokens) == 120 and tokens == [v0] * k + [v0 + 1] * (120 - k) and k >= 3


def test_an_unpaused_update_waits_for_in_flight_requests(server, tiny_model_dir):
    async def scenario():
        v0 = int((await call(server.url, KEY, "GET", "/model_info"))[1]["weight_version"])
        order = []

        async def logged(label, coro):
            reply = await coro
            order.append(label)
            return reply
        first = asyncio.create_task(logged("first", long_generate(server.url, "inflight", 80)))
        await wait_for(server.url, KEY, lambda s: s["running_output_tokens"] >= 3, first)
        updating = asyncio.create_task(logged("update", post(
            server.url, KEY, "/update_weights_from_disk", {"model_path": str(tiny_model_dir),
                                                          "weight_version": str(v0 + 1)})))
        await wait_for(server.url, KEY, lambda s: s["running_output_tokens"] >= 6, first)
        later = asyncio.create_task(logged("later", long_generate(server.url, "later", 5)))   # behind the writer
        return v0, await first, await updating, await later, order

    v0, old, updated, later, order = run(scenario())
    assert updated[0] == 200 and order == ["first", "update", "later"]
    assert versions(old) == [v0] * 80 and versions(later) == [v0 + 1] * 5


@pytest.fixture(scope="module")
def glm_model_dir(tmp_path_factory):
    from checkpoints.init_model import init_model

    return init_model(tmp_path_factory.mktemp("glm") / "model", arch="glm4_moe", preset="tiny", seed=0)


def test_glm_routes_have_one_column_per_hidden_layer_dense_zero(glm_model_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(glm_model_dir, dtype=torch.float32).eval()
    assert model.config.first_k_dense_replace == 1 and model.config.num_hidden_layers == 4
    captured = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "Glm4MoeTopkRouter":   # model.layers.L.mlp.gate
            layer = int(name.split(".")[2])
            module.register_forward_hook(lambda m, i, out, layer=layer: captured.__setitem__(layer, out[2]))
    handle = _launch(glm_model_dir)
    try:
        async def scenario():
            engine = SGLangEngine(handle.url, api_key=KEY, moe_topk=2)
            try:
                return await engine.generate(GenerateRequest(rid="glm", input_ids=PROMPT, max_new_tokens=12, seed=5,
                                                             return_routed_experts=True))
            finally:
                await engine.close()
        result = run(scenario())
    finally:
        handle.stop()
    tokens = PROMPT + result.output_ids
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    fed = len(tokens) - 1
    routes = result.routed_experts
    assert sorted(captured) == [1, 2, 3]
    assert routes.shape == (fed, 4, 2) and not routes[:, 0].any()           # layer 0 is dense: zeros
    for layer in (1, 2, 3):   # global layer L in column L (not L - 1), as SGLang's layer_id
        want = captured[layer][:fed].sort(-1).values.to(torch.int32)
        assert torch.equal(routes[:, layer].sort(-1).values, want), layer


def test_tp2_joins_as_two_ranks_and_each_receives(tiny_model_dir):
    on_disk = load_file(str(tiny_model_dir / "model.safetensors"))
    names = ["model.layers.1.mlp.experts.3.gate_proj.weight", "model.norm.weight", "lm_head.weight"]
    gen = torch.Generator().manual_seed(9)
    new = {n: torch.randn(on_disk[n].shape, generator=gen) for n in names}
    port, group_name, box = free_port(), "tp_group", {}
    handle = _launch(tiny_model_dir, "--tp", "2")

    def sender():   # world = trainer + 2 TP ranks of the one engine
        box["group"] = init_weight_update_group("127.0.0.1", port, 0, 3, group_name, "gloo", timeout_s=60)
        dist.broadcast(flatten_bucket([new[n] for n in names]), src=0, group=box["group"])

    async def scenario():
        too_small = await post(handle.url, KEY, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": "gloo"})
        thread = threading.Thread(target=sender)
        thread.start()
        joined = await post(handle.url, KEY, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
            "group_name": group_name, "backend": "nccl"})
        await post(handle.url, KEY, "/begin_weight_update")
        updated = await post(handle.url, KEY, "/update_weights_from_distributed", {
            "names": names, "dtypes": ["float32"] * 3, "shapes": [list(new[n].shape) for n in names],
            "group_name": group_name, "load_format": "flattened_bucket", "weight_version": "2"})
        await asyncio.to_thread(thread.join, 120)
        await post(handle.url, KEY, "/end_weight_update")
        engine = SGLangEngine(handle.url, api_key=KEY)
        weights = [await engine.get_weights_by_name(n) for n in names]
        await engine.close()
        destroyed = await post(handle.url, KEY, "/destroy_weights_update_group", {"group_name": group_name})
        info = (await call(handle.url, KEY, "GET", "/sao_server_info"))[1]
        return too_small, joined, updated, weights, destroyed, info

    try:
        too_small, joined, updated, weights, destroyed, info = run(scenario())
    finally:
        handle.stop()
    dist.destroy_process_group(box["group"])
    assert too_small[0] == 400 and "world_size 2" in too_small[1]["error"]["message"]
    assert joined[0] == 200 and updated[0] == 200 and destroyed[0] == 200 and info["tp"] == 2
    for name, got in zip(names, weights):
        assert torch.equal(got, new[name]), name


def test_health_is_503_while_starting_and_can_skip_generation(tiny_model_dir, monkeypatch):
    from aiohttp.test_utils import TestClient, TestServer

    from rollout.engines.reference_server.app import build_app
    from rollout.engines.reference_server.health import warmup
    from rollout.engines.reference_server.server import ServeOptions, build_state

    async def scenario():
        state = build_state(ServeOptions(model=str(tiny_model_dir), max_context=256, insecure=True))
        state.scheduler.start()
        client = TestClient(TestServer(build_app(state)))
        await client.start_server()
        try:
            out = {"starting": (await client.get("/health")).status, "status": state.status}
            await warmup(state)
            out["up"] = (await client.get("/health")).status
            await client.post("/pause_generation", json={"mode": "retract"})
            monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
            state.health_timeout_s = 1
            out["no_generation"] = [(await client.get(p)).status for p in ("/health", "/health_generate")]
            state.exiting = True
            out["exiting"] = (await client.get("/health")).status
            return out
        finally:
            await client.close()
            state.scheduler.stop()

    out = run(scenario())
    assert out["starting"] == 503 and out["status"] == "Starting" and out["up"] == 200
    assert out["no_generation"] == [200, 503] and out["exiting"] == 503
