"""Pause/continue, weight updates and weight reads through the SGLang client (one server per module).

Weight updates travel as SGLang sends them: this test process is rank 0 of a gloo group (formed as
SGLang's init_custom_process_group does) and broadcasts one tensor per name and a flattened bucket,
inside a weight-update session (/begin_weight_update ... /end_weight_update), as SGLang 0.5.23 requires.
Expected values are checked against the on-disk safetensors and against an HF model loaded from a
directory holding the updated checkpoint, never against the server's own name mapping.
"""
from __future__ import annotations

import asyncio
import shutil
import threading

import aiohttp
import pytest
import torch
import torch.distributed as dist
from reference_http import post, scheduler_state, wait_for
from safetensors.torch import load_file, save_file

from rollout.engines.engine import EngineError, GenerateRequest
from rollout.engines.reference_server import launch_local
from rollout.engines.reference_server.weight_group import flatten_bucket, init_weight_update_group
from rollout.engines.sglang_client import SGLangEngine, generate_body, parse_generate_reply
from sao_megatron.core.ports import free_port

KEY = "ctl-key"
PROMPT = [10, 11, 12, 13]
UPDATED = ["model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight",
           "model.layers.2.mlp.experts.5.down_proj.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.layers.2.mlp.gate.weight", "model.norm.weight", "lm_head.weight"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    handle = launch_local(tiny_model_dir, api_key=KEY, timeout_s=300,
                          extra_args=["--max-context", "512", "--weight-sync-timeout-s", "120"])
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def on_disk(tiny_model_dir):
    return load_file(str(tiny_model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def updated_dir(tiny_model_dir, on_disk, tmp_path_factory):
    """A copy of the tiny checkpoint whose UPDATED tensors are replaced by fresh random ones."""
    out = tmp_path_factory.mktemp("updated")
    for f in tiny_model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(5)
    tensors = dict(on_disk)
    for name in UPDATED:
        tensors[name] = torch.randn(on_disk[name].shape, generator=gen) * 0.05
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def run(coro_fn, server):
    async def main():
        engine = SGLangEngine(server.url, api_key=KEY, name="ctl", moe_topk=2)
        try:
            return await coro_fn(engine)
        finally:
            await engine.close()
    return asyncio.run(main())


async def _wait(engine, predicate, task=None):
    return await wait_for(engine.url, KEY, predicate, task)


async def _ok(engine, path: str, body: dict) -> dict:
    status, reply = await post(engine.url, KEY, path, body)
    assert status == 200 and reply["success"], (path, status, reply)
    return reply


async def long_generate(engine, req: GenerateRequest):
    """/generate with ignore_eos (not in the Engine request type) so the request surely runs long."""
    body = generate_body(req)
    body["sampling_params"]["ignore_eos"] = True
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
        async with session.post(engine.url + "/generate", json=body) as reply:
            assert reply.status == 200, await reply.text()
            return parse_generate_reply(await reply.json(), req, 2, 4, engine.name)


def teacher_logprobs(model_dir, tokens, n_prompt):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
    return [float(logp[n_prompt - 1 + t, tok]) for t, tok in enumerate(tokens[n_prompt:])]


def test_get_weights_by_name_matches_checkpoint(server, on_disk):
    names = ["model.layers.0.mlp.experts.6.gate_proj.weight", "model.layers.0.mlp.experts.6.up_proj.weight",
             "model.layers.3.mlp.experts.0.down_proj.weight", "model.embed_tokens.weight"]
    got = run(lambda e: asyncio.gather(*(e.get_weights_by_name(n) for n in names)), server)
    for name, tensor in zip(names, got):
        assert torch.equal(tensor, on_disk[name]), name
    with pytest.raises(EngineError, match="ctl.*not a parameter"):
        run(lambda e: e.get_weights_by_name("model.layers.0.nope.weight"), server)


def test_pause_in_place_keeps_request_and_stamps_new_version(server, tiny_model_dir):
    req = GenerateRequest(rid="inplace", input_ids=PROMPT, max_new_tokens=200, seed=1)

    async def scenario(engine):
        task = asyncio.create_task(long_generate(engine, req))
        await _wait(engine, lambda s: s["running_output_tokens"] >= 3, task)
        await engine.pause("in_place")
        paused = await _wait(engine, lambda s: s["paused"])
        # same weights, v1; flush_cache false: SGLang refuses the flush with a request in the batch
        await _ok(engine, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "1",
                                                        "flush_cache": False})
        still = await scheduler_state(engine.url, KEY)
        await engine.resume()
        return await task, paused, still, await engine.weight_version()

    result, paused, still, version = run(scenario, server)
    k = paused["running_output_tokens"]
    assert still["running"] == 1 and still["running_output_tokens"] == k   # nothing decoded while paused
    assert result.finish_reason == "length" and len(result.output_ids) == 200
    assert result.output_weight_versions == [0] * k + [1] * (200 - k)
    assert result.weight_version == 1 and version == 1
    want = teacher_logprobs(tiny_model_dir, PROMPT + result.output_ids, len(PROMPT))
    assert max(abs(a - b) for a, b in zip(want, result.output_logprobs)) < 1e-5


def test_pause_retract_requeues_and_recomputes(server, tiny_model_dir):
    req = GenerateRequest(rid="retract", input_ids=PROMPT, max_new_tokens=150, seed=2)

    async def scenario(engine):
        task = asyncio.create_task(long_generate(engine, req))
        await _wait(engine, lambda s: s["running_output_tokens"] >= 3, task)
        await engine.pause("retract")
        stats = await _wait(engine, lambda s: s["paused"])
        await engine.resume()
        return await task, stats

    result, stats = run(scenario, server)
    assert stats["running"] == 0 and stats["waiting"] == 1        # KV dropped, request queued
    assert result.finish_reason == "length" and len(result.output_ids) == 150
    want = teacher_logprobs(tiny_model_dir, PROMPT + result.output_ids, len(PROMPT))
    assert max(abs(a - b) for a, b in zip(want, result.output_logprobs)) < 1e-5
    assert result.routed_experts.shape[0] == len(PROMPT) + 150 - 1


def test_pause_abort_ends_requests(server):
    req = GenerateRequest(rid="pabort", input_ids=PROMPT, max_new_tokens=300, seed=3)

    async def scenario(engine):
        task = asyncio.create_task(long_generate(engine, req))
        await _wait(engine, lambda s: s["running_output_tokens"] >= 2, task)
        await engine.pause("abort")
        result = await task
        queued = asyncio.create_task(engine.generate(GenerateRequest(rid="q", input_ids=PROMPT, max_new_tokens=3)))
        stats = await _wait(engine, lambda s: s["held_by_pause"] == 1)   # paused: new work waits at the gate
        await engine.resume()
        return result, stats, await queued

    result, stats, queued = run(scenario, server)
    assert result.finish_reason == "abort" and 2 <= len(result.output_ids) < 300
    assert stats["paused"] and stats["running"] == 0 and stats["waiting"] == 0 and not stats["scheduler_paused"]
    assert queued.finish_reason in ("length", "stop")


def test_gloo_broadcast_update_is_bit_exact_and_bumps_version(server, on_disk, updated_dir):
    new = load_file(str(updated_dir / "model.safetensors"))
    port, group_name = free_port(), "wu_test"
    flat_names, single_names = UPDATED[:4], UPDATED[4:]
    box = {}

    def sender():
        group = init_weight_update_group("127.0.0.1", port, 0, 2, group_name, "gloo", timeout_s=120)
        box["group"] = group
        dist.broadcast(flatten_bucket([new[n] for n in flat_names]), src=0, group=group)
        for name in single_names:
            dist.broadcast(new[name].clone(), src=0, group=group)

    async def scenario(engine):
        thread = threading.Thread(target=sender)
        thread.start()
        await engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name, "gloo")
        await _ok(engine, "/begin_weight_update", {"selector": "all"})
        meta = lambda names: ([str(new[n].dtype) for n in names], [list(new[n].shape) for n in names])
        await engine.update_weights_from_distributed(flat_names, *meta(flat_names), group_name, 4,
                                                     flattened_bucket=True)
        await engine.update_weights_from_distributed(single_names, *meta(single_names), group_name, 5,
                                                     flattened_bucket=False)
        await asyncio.to_thread(thread.join, 120)
        await _ok(engine, "/end_weight_update", {})
        weights = await asyncio.gather(*(engine.get_weights_by_name(n) for n in UPDATED))
        untouched = await engine.get_weights_by_name("model.layers.1.mlp.experts.2.gate_proj.weight")
        version = await engine.weight_version()
        gen = await engine.generate(GenerateRequest(rid="after", input_ids=PROMPT, max_new_tokens=10, seed=4))
        await engine.destroy_weights_update_group(group_name)
        return weights, untouched, version, gen

    weights, untouched, version, gen = run(scenario, server)
    dist.destroy_process_group(box["group"])
    for name, tensor in zip(UPDATED, weights):
        assert torch.equal(tensor, new[name]) and not torch.equal(tensor, on_disk[name]), name
    assert torch.equal(untouched, on_disk["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert version == 5 and gen.weight_version == 5 and gen.output_weight_versions == [5] * 10
    want = teacher_logprobs(updated_dir, PROMPT + gen.output_ids, len(PROMPT))
    assert max(abs(a - b) for a, b in zip(want, gen.output_logprobs)) < 1e-5


def test_update_from_disk_restores_and_errors_are_reported(server, tiny_model_dir, on_disk, tmp_path):
    async def scenario(engine):
        await engine.update_weights_from_disk(str(tiny_model_dir), weight_version=9)
        restored = await engine.get_weights_by_name(UPDATED[0])
        missing = await post(engine.url, KEY, "/update_weights_from_disk",
                             {"model_path": str(tmp_path / "missing"), "weight_version": "10"})
        await _ok(engine, "/begin_weight_update", {})
        no_group = await post(engine.url, KEY, "/update_weights_from_distributed", {
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "no_such_group"})
        await _ok(engine, "/end_weight_update", {})
        await engine.flush_cache()
        return restored, await engine.weight_version(), missing, no_group, await engine.health()

    restored, version, missing, no_group, healthy = run(scenario, server)
    assert torch.equal(restored, on_disk[UPDATED[0]]) and version == 9
    assert missing[0] == 400 and "not a directory" in missing[1]["message"] and missing[1]["num_paused_requests"] == 0
    assert no_group == (400, {"success": False, "message": "Failed to receive weights: Group no_such_group not in "
                                                          "[]. Please call `init_weights_update_group` first."})
    assert healthy
