"""DSA indexer top-k from engine to TrainBatch: decode and shape check, what cannot be replayed, the
Sample field (checks, dict and dump round trips, driver state), TrainBatch alignment."""
from __future__ import annotations

import asyncio
import base64
import logging

import numpy as np
import pytest
import torch
from aiohttp import web

from rollout.dump import RolloutDumper, load_step
from rollout.engines.engine import EngineError, GenerateRequest
from rollout.engines.indexer_topk import (decode_indexer_topk, encode_indexer_topk, fill_every_key_rows,
                                  indexer_shape_from_config, logical_violation)
from rollout.engines.sglang_client import SGLangEngine, generate_body, parse_generate_reply
from sao_megatron.core.records import Sample, SampleStatus
from sao_megatron.trainer.batching import pack_samples

LAYERS, TOPK = 3, 2


def req(rid: str, new: int = 2) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=[1, 2, 3], max_new_tokens=new, return_routed_experts=False)


REQ = req("r1", 4)


def logical(rows: int, layers: int = LAYERS, topk: int = TOPK) -> torch.Tensor:
    """Valid logical selections: row t picks t, t-1, ... (-1 where t < slot)."""
    t = torch.arange(rows).view(-1, 1, 1)
    picks = t - torch.arange(topk).view(1, 1, -1)
    return torch.where(picks >= 0, picks, -1).expand(rows, layers, topk).to(torch.int32).contiguous()


def reply(indexer=None, output_ids=(7, 8)):
    meta = {"finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "weight_version": "1",
            "output_token_logprobs": [[-0.5, 7, None], [-1.25, 8, None]]}
    if indexer is not None:
        meta["indexer_topk"] = indexer
    return {"text": "", "output_ids": list(output_ids), "meta_info": meta}


def test_round_trip_and_rows_below_topk_made_canonical():
    topk = logical(6)
    topk[1, 0] = torch.tensor([1, 0], dtype=torch.int32)     # same set as [0, 1], other order
    back = decode_indexer_topk(encode_indexer_topk(topk), 6, LAYERS, TOPK)
    assert back.dtype == torch.int32 and back.shape == (6, LAYERS, TOPK)
    assert back[0, 0].tolist() == [0, -1] and back[1, 0].tolist() == [0, 1]
    assert torch.equal(back[2:], topk[2:])
    assert fill_every_key_rows(torch.zeros(0, LAYERS, TOPK, dtype=torch.int32)).shape == (0, LAYERS, TOPK)


@pytest.mark.parametrize("data, needle", [
    (base64.b64encode(np.zeros(5 * LAYERS * TOPK, dtype="<i4").tobytes()).decode(),
     "has 30 int32 values; expected shape [tokens - 1, num_hidden_layers, index_topk] = [4, 3, 2] (24 values)"),
    (base64.b64encode(np.zeros(4 * LAYERS * 4, dtype="<i4").tobytes()).decode(), "(index_topk 4?)"),
    ("not base64!", "not valid base64"),
    (17, "must be a base64 string"),
])
def test_wrong_shape_is_one_line_naming_field_and_shapes(data, needle):
    with pytest.raises(ValueError) as info:
        decode_indexer_topk(data, 4, LAYERS, TOPK)
    message = str(info.value)
    assert "meta_info.indexer_topk" in message and needle in message and "\n" not in message


def test_logical_violation_finds_slots_and_duplicates():
    assert logical_violation(logical(5)) is None
    future = logical(5)
    future[3, 1, 0] = 4
    assert "row 3 layer 1 holds 4" in logical_violation(future)
    twice = logical(5)
    twice[4, 2] = torch.tensor([2, 2])
    assert logical_violation(twice) == "row 4 layer 2 selects one key twice"
    assert "holds -5" in logical_violation(torch.full((2, 1, 1), -5, dtype=torch.int32))


def test_parse_reply_decodes_only_when_asked():
    data = reply(encode_indexer_topk(logical(4)))
    assert parse_generate_reply(data, REQ, None, None, "e0").indexer_topk is None     # not asked
    res = parse_generate_reply(data, REQ, None, None, "e0", (LAYERS, TOPK))
    assert torch.equal(res.indexer_topk, fill_every_key_rows(logical(4)))
    assert parse_generate_reply(reply(), REQ, None, None, "e0", (LAYERS, TOPK)).indexer_topk is None


def test_body_asks_only_for_an_indexer_model():
    assert "return_indexer_topk" not in generate_body(REQ)
    assert generate_body(REQ, return_indexer_topk=True)["return_indexer_topk"] is True


async def _serve(replies: dict):
    bodies = []

    async def generate(request):
        body = await request.json()
        bodies.append(body)
        return web.json_response(replies[body["rid"]])

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}", bodies


def test_engine_client_wrong_shape_error_missing_and_slots(caplog):
    slots = logical(4)
    slots[3, 0, 0] = 977      # a KV-cache slot, as SGLang's fused top-k returns
    replies = {"good": reply(encode_indexer_topk(logical(4))), "short": reply(encode_indexer_topk(logical(3))),
               "none": reply(), "none2": reply(), "slots": reply(encode_indexer_topk(slots))}

    async def main():
        runner, url, bodies = await _serve(replies)
        engine = SGLangEngine(url, name="eng3", index_topk=TOPK, num_indexer_layers=LAYERS)
        plain = SGLangEngine(url, name="dense")   # the model has no indexer: never asks
        out = {rid: await engine.generate(req(rid))
               for rid in ("good", "none", "none2")}
        with pytest.raises(EngineError) as info:
            await engine.generate(req("short"))
        other = SGLangEngine(url, name="eng4", index_topk=TOPK, num_indexer_layers=LAYERS)
        out["slots"] = await other.generate(req("slots"))
        out["plain"] = await plain.generate(req("good"))
        for e in (engine, other, plain):
            await e.close()
        await runner.cleanup()
        return out, str(info.value), bodies

    with caplog.at_level(logging.WARNING, logger="rollout.engines.sglang_client"):
        out, error, bodies = asyncio.run(main())
    assert out["good"].indexer_topk.shape == (4, LAYERS, TOPK)
    assert error == ("engine eng3: /generate reply for rid short: meta_info.indexer_topk has 18 int32 values; "
                     "expected shape [tokens - 1, num_hidden_layers, index_topk] = [4, 3, 2] (24 values)")
    assert out["none"].indexer_topk is None and out["slots"].indexer_topk is None
    assert out["plain"].indexer_topk is None and "return_indexer_topk" not in bodies[-1]
    assert all(b.get("return_indexer_topk") is True for b in bodies[:-1])
    warnings = [r.getMessage() for r in caplog.records]
    assert len([w for w in warnings if w.startswith("engine eng3:")]) == 1          # said once per engine
    assert any("--enable-return-indexer-topk" in w for w in warnings)
    assert any(w.startswith("engine eng4:") and "SGLANG_DSA_FUSE_TOPK=0" in w for w in warnings)


def test_indexer_shape_from_config(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4, "index_topk": 4}')
    assert indexer_shape_from_config(tmp_path) == {"index_topk": 4, "num_indexer_layers": 4}
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4}')
    assert indexer_shape_from_config(tmp_path) == {"index_topk": None, "num_indexer_layers": None}
    with pytest.raises(ValueError, match="cannot read the indexer's shape"):
        indexer_shape_from_config(tmp_path / "missing")


def sample(uid, prompt, response, indexer=True):
    n, total = len(response), len(prompt) + len(response)
    return Sample(uid=uid, prompt_index=0, prompt_ids=list(prompt), response_ids=list(response), loss_mask=[1] * n,
                  rollout_logprobs=[-0.5] * n, weight_versions=[1] * n, status=SampleStatus.COMPLETED,
                  routed_experts=torch.zeros(total - 1, LAYERS, 2, dtype=torch.int32),
                  indexer_topk=logical(total - 1) if indexer else None)


def test_sample_checks_round_trips_and_driver_state(tmp_path):
    s = sample("a", [1, 2], [5, 6, 7])
    s.check()
    back = Sample.from_dict(s.to_dict())
    assert torch.equal(back.indexer_topk, s.indexer_topk) and back.indexer_topk.dtype == torch.int32
    path = RolloutDumper(tmp_path).write(0, [s, sample("b", [1], [5], indexer=False)])
    loaded = load_step(path)
    assert torch.equal(loaded[0].indexer_topk, s.indexer_topk) and loaded[1].indexer_topk is None
    s.indexer_topk = logical(3)
    with pytest.raises(ValueError, match="sample a: indexer_topk has 3 rows, expected 4"):
        s.check()
    s.indexer_topk = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"indexer_topk has shape \(4, 2\), expected \[tokens - 1, "
                                         r"num_hidden_layers, index_topk\]"):
        s.check()
    pending = sample("c", [1, 2], [5])
    pending.status = SampleStatus.ABORTED
    assert "indexer_topk" not in pending.work_state() and "routed_experts" not in pending.work_state()
    one = Sample.from_dict(sample("d", [1], []).to_dict())   # one token: no position was fed
    assert one.indexer_topk.shape[0] == 0
    one.check()


def test_train_batch_carries_indexer_topk_aligned_like_routes():
    samples = [sample("a", [1, 2], [5, 6, 7]), sample("b", [1, 2, 3, 4, 5, 6], [8])]
    batch = pack_samples(samples, token_budget=1000).batches[0]
    assert batch.indexer_topk.shape == (2, 7, LAYERS, TOPK) and batch.indexer_topk.dtype == torch.int32
    by_uid = {uid: r for r, uid in enumerate(batch.sample_uids)}
    for s in samples:
        row = batch.indexer_topk[by_uid[s.uid]]
        assert torch.equal(row[:s.num_tokens - 1], s.indexer_topk)       # position t: the query at t
        assert (row[s.num_tokens - 1:] == -1).all()                        # last token and padding
    mixed = pack_samples([samples[0], sample("c", [1], [5, 6], indexer=False)], 1000).batches[0]
    assert mixed.indexer_topk is None and mixed.routed_experts is not None   # all or nothing per batch
    assert pack_samples(samples, 1000, with_routes=False).batches[0].indexer_topk is None
