"""The reference server serves the GLM-5 / DeepSeek-V3 class (MLA, DSA): a slot cache whose keys and
values differ in width, prefill / decode / teacher-forced passes that agree (logprobs to 1e-5 in
fp32, DSA selections exactly), and SGLang's indexer_topk protocol with logical key positions.

The tiny presets keep index_topk (4) below every sequence here, so every test attends sparsely; the
glm5 preset's layer 2 reuses layer 1's selection (indexer_types F F S F).
"""
from __future__ import annotations

import asyncio
import base64
import random
import threading

import aiohttp
import pytest
import torch

from checkpoints.arch import ARCHS
from rollout.engines.engine import GenerateRequest
from rollout.engines.indexer_topk import fill_every_key_rows, indexer_shape_from_config, logical_violation
from rollout.engines.reference_server import launch_local
from rollout.engines.reference_server.model_runner import ModelRunner, SlotCache
from rollout.engines.reference_server.protocol import build_response
from rollout.engines.reference_server.sampling import SamplingParams
from rollout.engines.reference_server.scheduler import Request, Scheduler
from rollout.engines.routed_experts import route_shape_from_config
from rollout.engines.sglang_client import SGLangEngine

TOL = 1e-5   # fp32 logprobs: prefill/decode vs teacher-forced differ by float summation order only


def _model(tmp_path_factory, arch: str, preset: str = "tiny"):
    if arch not in ARCHS:
        pytest.skip(f"architecture {arch} is not registered yet")
    from checkpoints.init_model import init_model

    return init_model(tmp_path_factory.mktemp(f"{arch}_{preset}") / "model", arch=arch, preset=preset, seed=0)


@pytest.fixture(scope="module")
def glm5_dir(tmp_path_factory):
    return _model(tmp_path_factory, "glm5")


@pytest.fixture(scope="module", params=[("glm5", "tiny"), ("deepseek_v3", "tiny"), ("deepseek_v3", "tiny-no-q-lora")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def mla_dir(request, tmp_path_factory):
    return _model(tmp_path_factory, *request.param)


def test_slot_cache_keys_values_and_indexer_keys_of_their_own_widths():
    cache = SlotCache(num_layers=1, max_batch=3, capacity=2)
    keys, values, index = torch.randn(2, 4, 3, 24), torch.randn(2, 4, 3, 16), torch.randn(2, 3, 16)
    cache.grow(3)
    rows, cols = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 2, 0, 1])     # row 1 fed 2 tokens
    cache.rows, cache.kv_len = 2, 3
    cache.write_rows, cache.write_pos, cache.src_rows, cache.src_cols = rows, cols, rows, cols
    k, v = cache.update(keys, values, 0)
    assert k.shape == (2, 4, 3, 24) and v.shape == (2, 4, 3, 16) and cache.capacity == 4
    assert torch.equal(v[1, :, :2], values[1, :, :2]) and not v[1, :, 2].any()
    assert torch.equal(cache.update_indexer(index, 0)[0], index[0])
    cache.move_row(0, 2, 3)
    assert torch.equal(cache.keys[0][2, :, :3], keys[0]) and torch.equal(cache.index_keys[0][2, :3], index[0])
    cache.grow(9)
    assert cache.capacity == 16 and cache.values[0].shape == (3, 4, 16, 16) and cache.index_keys[0].shape == (3, 16, 16)


def _generate(runner: ModelRunner, prompts: list[list[int]], max_new: list[int], capture: bool = True):
    """Run `prompts` through the batching scheduler together (new prompts join running decodes, a
    finished row's slot is refilled by the last one): each finished Request."""
    scheduler = Scheduler(runner, eos_token_ids=[], seed=0, enable_return_indexer_topk=capture)
    done, lock = [], threading.Lock()
    finished = threading.Event()

    def deliver(req):
        with lock:
            done.append(req)
            if len(done) == len(prompts):
                finished.set()

    scheduler.start()
    try:
        for i, (prompt, new) in enumerate(zip(prompts, max_new)):
            scheduler.submit(Request(rid=f"r{i}", input_ids=prompt, deliver=deliver, return_routes=runner.top_k > 0,
                                     return_indexer_topk=True,
                                     params=SamplingParams(max_new_tokens=new, temperature=0.7, sampling_seed=i)))
        assert finished.wait(120), "generation did not finish"
    finally:
        scheduler.stop()
    assert scheduler.error is None, scheduler.error
    return sorted(done, key=lambda r: int(r.rid[1:]))


def test_prefill_decode_and_teacher_forced_agree(mla_dir):
    """Every request's logprobs equal a teacher-forced pass at the sampling temperature, and its DSA
    selections equal the ones that pass makes: the index-key cache, the tie rule and the causal
    selection make decode pick what a whole-sequence pass picks."""
    runner = ModelRunner(mla_dir, max_batch=3)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 100) for _ in range(n)] for n in (3, 11, 6, 20, 9)]
    done = _generate(runner, prompts, [24, 9, 17, 5, 30])
    for req in done:
        tokens = req.input_ids + req.output_ids
        scored = runner.score(tokens[:-1])
        logp = torch.log_softmax(scored.logits / 0.7, dim=-1)
        want = [float(logp[len(req.input_ids) - 1 + t, tok]) for t, tok in enumerate(req.output_ids)]
        assert max(abs(a - b) for a, b in zip(want, req.logprobs)) < TOL, req.rid
        fed = len(tokens) - 1
        if runner.index_topk:
            assert fed > runner.index_topk
            assert torch.equal(req.indexer_topk[:fed], scored.indexer_topk), req.rid
            assert logical_violation(req.indexer_topk[:fed]) is None
        else:
            assert req.indexer_topk is None and scored.indexer_topk is None
        if req.routes is not None:
            assert torch.equal(req.routes[:fed], scored.routes), req.rid


def test_shared_layers_mirror_their_source_and_replay_decides_attention(glm5_dir):
    runner = ModelRunner(glm5_dir, max_batch=1)
    assert runner.indexer.sources == [0, 1, 1, 3]                  # indexer_types F F S F
    rng = random.Random(1)
    tokens = [rng.randrange(3, 100) for _ in range(24)]
    scored = runner.score(tokens)
    assert torch.equal(scored.indexer_topk[:, 2], scored.indexer_topk[:, 1])
    assert (scored.indexer_topk[10:] >= 0).all()                    # 4 keys of 11+ are always there
    # the trainer's replay: the engine's own choices give its logits back, other valid ones do not
    same = runner.score(tokens, replay_indexer=scored.indexer_topk)
    assert torch.allclose(same.logits, scored.logits, atol=1e-6)
    other = scored.indexer_topk.clone()
    other[8:] = torch.arange(4, dtype=torch.int32)                  # keys 0..3 instead
    moved = runner.score(tokens, replay_indexer=other)
    assert torch.equal(moved.indexer_topk, other)                   # what attention used, shared layer too
    assert (moved.logits[8:] - scored.logits[8:]).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"replay_indexer has shape \(24, 4, 3\); expected \[<= 24, 4, 4\]"):
        runner.score(tokens, replay_indexer=scored.indexer_topk[..., :3])


def test_no_indexer_no_capture(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, max_batch=2)
    assert runner.index_topk == 0
    assert not Scheduler(runner, [], enable_return_indexer_topk=True).capture_indexer
    (req,) = _generate(runner, [[5, 6, 7]], [3])
    assert req.indexer_topk is None and "indexer_topk" not in build_response(req, None, 0)["meta_info"]


@pytest.fixture(scope="module")
def servers(glm5_dir):
    """(flag on, flag off) reference servers of the tiny glm5."""
    on = launch_local(glm5_dir, insecure=True, timeout_s=300, seed=3, extra_args=["--enable-return-indexer-topk"])
    try:
        off = launch_local(glm5_dir, insecure=True, timeout_s=300, seed=3)
    except BaseException:
        on.stop()
        raise
    yield on, off
    on.stop()
    off.stop()


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", json=body) as reply:
            return reply.status, await reply.json(content_type=None)


def test_protocol_asked_flag_on_flag_off_and_bad_field(servers, glm5_dir):
    """SGLang 0.5.23: meta_info.indexer_topk (base64 int32 [prompt+output-1, num_hidden_layers,
    index_topk]) only when the request asks AND the server runs with --enable-return-indexer-topk;
    asked without the flag, the reply simply has no such field (the capturer is off)."""
    on, off = servers
    body = {"input_ids": [5, 9, 14, 3, 22, 7], "sampling_params": {"max_new_tokens": 5, "temperature": 0.0},
            "return_indexer_topk": True}

    async def main():
        return [await _post(on.url, body), await _post(on.url, {**body, "return_indexer_topk": False}),
                await _post(off.url, body), await _post(on.url, {**body, "return_indexer_topk": "yes"})]

    (s1, asked), (s2, not_asked), (s3, flag_off), (s4, bad) = asyncio.run(main())
    assert (s1, s2, s3, s4) == (200, 200, 200, 400)
    n = len(asked["output_ids"])
    raw = base64.b64decode(asked["meta_info"]["indexer_topk"])
    assert len(raw) == (6 + n - 1) * 4 * 4 * 4                      # int32 [10, 4 layers, index_topk 4]
    assert "indexer_topk" not in not_asked["meta_info"] and "indexer_topk" not in flag_off["meta_info"]
    assert "return_indexer_topk" in bad["error"]["message"]


def test_client_gets_logical_positions_equal_to_a_teacher_forced_pass(servers, glm5_dir):
    on, _ = servers
    shape = {**route_shape_from_config(glm5_dir), **indexer_shape_from_config(glm5_dir)}
    rng = random.Random(2)
    requests = [GenerateRequest(rid=f"g{i}", input_ids=[rng.randrange(3, 100) for _ in range(4 + 5 * i)],
                                max_new_tokens=14, temperature=0.7, seed=i) for i in range(4)]

    async def main():
        engine = SGLangEngine(on.url, name="ref", **shape)
        try:
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            await engine.close()

    results = asyncio.run(main())
    runner = ModelRunner(glm5_dir, max_batch=1)
    for req, res in zip(requests, results):
        tokens = req.input_ids + res.output_ids
        scored = runner.score(tokens[:-1])
        assert res.indexer_topk.shape == (len(tokens) - 1, 4, 4)
        assert torch.equal(res.indexer_topk, fill_every_key_rows(scored.indexer_topk)), req.rid
        assert torch.equal(res.routed_experts.sort(-1).values, scored.routes.sort(-1).values), req.rid
        logp = torch.log_softmax(scored.logits / 0.7, dim=-1)
        want = [float(logp[len(req.input_ids) - 1 + t, tok]) for t, tok in enumerate(res.output_ids)]
        assert max(abs(a - b) for a, b in zip(want, res.output_logprobs)) < TOL, req.rid
