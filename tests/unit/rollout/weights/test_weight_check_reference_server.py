"""/weights_checker on the reference server (a real process) and check_equal through it:
- the route answers in SGLang 0.5.23's JSON shape (checksums hand-computed with hashlib), refuses
  SGLang's other actions, a bad selector and unknown actions with 400 naming them;
- after a real broadcast sync check_equal passes on all 47 served tensors; after a deliberately wrong
  update of one expert it fails naming the fused tensor that holds it;
- a malformed /weights_checker reply is a one-line EngineError naming the field.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import urllib.error
import urllib.request

import pytest
import torch

from checkpoints.hf_io import HFCheckpoint
from rollout.engines.engine import EngineError
from rollout.engines.sglang_client import SGLangEngine
from rollout.weights.check import WeightMismatchError, check_weight_update_equal
from rollout.weights import BroadcastWeightSync
from sao_megatron.core.config import WeightSyncConfig


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from rollout.engines.reference_server import launch_local

    srv = launch_local(tiny_model_dir, port=0, api_key="k", timeout_s=300)
    yield srv
    srv.stop()


def _http(srv, method: str, body=None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + "/weights_checker", data=data, method=method,
                                 headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _engine(srv, name="ref-0"):
    return SGLangEngine(srv.url, api_key="k", name=name, control_timeout_s=30, weight_timeout_s=120)


def test_route_answers_in_sglangs_shape(server, tiny_model_dir):
    status, body = _http(server, "GET")
    assert status == 200 and set(body) == {"success", "message", "ranks", "per_engine_checksum"}
    [rank] = body["ranks"]
    assert set(rank) == {"checksums", "per_gpu_checksum", "parallelism_info"}
    assert rank["parallelism_info"] == [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                         "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]
    sums = rank["checksums"]
    assert len(sums) == 47 and not any("inv_freq" in n for n in sums)
    assert "model.layers.0.mlp.experts.gate_up_proj" in sums
    norm = HFCheckpoint(tiny_model_dir)["model.norm.weight"]          # fp32 on a CPU server: sha256 of the bytes
    assert sums["model.norm.weight"] == hashlib.sha256(norm.numpy().tobytes()).hexdigest()[:16]
    h = hashlib.sha256()
    for name in sorted(sums):
        h.update(name.encode() + sums[name].encode())
    assert rank["per_gpu_checksum"] == h.hexdigest()
    assert body["per_engine_checksum"] == hashlib.sha256(h.hexdigest().encode()).hexdigest()
    status, post = _http(server, "POST", {"action": "checksum", "selector": "target"})
    assert status == 200 and post == body


def test_route_skip_list_draft_selector_and_refusals(server):
    status, body = _http(server, "POST", {"skip_tensor_list": ["mlp.gate."]})
    assert status == 200 and len(body["ranks"][0]["checksums"]) == 43
    assert _http(server, "POST", {"selector": "draft"}) == (200, {"success": True, "message": "Success."})
    assert _http(server, "POST", {"selector": "both"}) == (400, {
        "success": False, "message": "invalid selector 'both'; expected 'target', 'draft', or 'all'"})
    assert _http(server, "POST", {"action": "bogus"}) == (400, {"success": False,
                                                                "message": "Unsupported action='bogus'"})
    status, body = _http(server, "POST", {"action": "snapshot"})
    assert status == 400 and body["success"] is False and "action 'snapshot'" in body["message"]


def _trained(model_dir):
    g = torch.Generator().manual_seed(11)
    return [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in HFCheckpoint(model_dir).items()]


def test_check_equal_after_a_real_sync_then_a_wrong_update(server, tiny_model_dir):
    named = _trained(tiny_model_dir)
    wrong = "model.layers.2.mlp.experts.5.up_proj.weight"

    async def scenario():
        engine = _engine(server)
        try:
            sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=0.05, timeout_s=120), [engine])
            async with sync.update_session():   # the caller holds the session (and any pause)
                await sync.push(named, version=3)
            passed = await check_weight_update_equal([engine], named)
            async with sync.update_session():
                await sync.push([(wrong, dict(named)[wrong] + 1e-3)], version=4)   # one expert now differs
            await sync.close()
            try:
                await check_weight_update_equal([engine], named)
            except WeightMismatchError as err:
                return passed, str(err)
            return passed, ""
        finally:
            await engine.close()

    passed, failure = asyncio.run(scenario())
    assert [(r.engine, r.layout, r.compared, r.unverified) for r in passed] == [("ref-0", "hf", 47, 0)]
    assert failure.startswith("engine ref-0 (tp_rank 0 of 1): model.layers.2.mlp.experts.gate_up_proj differs "
                              "from the trainer (engine checksum ")


class _Replying(SGLangEngine):
    """An SGLangEngine whose server answers /weights_checker with a fixed body."""

    def __init__(self, body):
        super().__init__("http://127.0.0.1:9", name="bad")
        self.body = body

    async def _call(self, method, path, body, timeout_s):
        assert path == "/weights_checker" and body == {"action": "checksum", "selector": "target"}
        return 200, self.body


@pytest.mark.parametrize("body, field", [
    ({"success": True, "message": "Success.", "ranks": [{"checksums": {"a": "01"}, "per_gpu_checksum": "x",
                                                          "parallelism_info": []}], "per_engine_checksum": "y"},
     "'ranks[0].per_gpu_checksum' does not match"),
    ({"success": True, "message": "Success.", "ranks": "none", "per_engine_checksum": "y"}, "'ranks' missing"),
    ({"message": "no success field"}, "without a 'success' field"),
])
def test_malformed_reply_is_a_one_line_engine_error_naming_the_field(body, field):
    with pytest.raises(EngineError) as err:
        asyncio.run(_Replying(body).check_weights(selector="target"))
    assert str(err.value).startswith("engine bad: /weights_checker") and field in str(err.value)
    assert "\n" not in str(err.value)
