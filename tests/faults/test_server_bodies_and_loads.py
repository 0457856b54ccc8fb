"""The reference server, third round (issue 26.1): bodies no parser or encoder can take, bad weight
files, a weight file that hangs, and group layouts that would make the server its own sender.

Every case was a 500 or a frozen server before: a deeply nested body (RecursionError in json), a
5000-digit integer (Python's int/str digit limit), a lone UTF-16 surrogate in `text` (the tokenizer
refuses it), `truncate_size=abc` in a query, a truncated safetensors file; a FIFO named by
/update_weights_from_disk blocked the scheduler thread (so /generate and /health) until it
unblocked; rank_offset 0 made the server the broadcast's source and "received" torch.empty memory.
A property-based pass throws random JSON at /generate: never a 500, never a dead server.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.engines.reference_server import launch_local
from rollout.engines.reference_server.protocol import GENERATE_FIELDS, SAMPLING_FIELDS

KEY = "round3-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
READ_TIMEOUT_S = 4   # the server's --weight-sync-timeout-s: how long a disk read may take
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    handle = launch_local(tiny_model_dir, api_key=KEY, timeout_s=300, seed=1,
                          extra_args=["--max-context", "256", "--max-batch", "4",
                                      "--weight-sync-timeout-s", str(READ_TIMEOUT_S)])
    yield handle
    handle.stop()


def _call(url: str, path: str, data: bytes | None = None, method: str = "POST", timeout_s: float = 120):
    request = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **AUTH})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _message(text: str) -> str:
    body = json.loads(text)
    return body["error"]["message"] if "error" in body else body["message"]


def _good_request_works(url: str) -> None:
    status, text = _call(url, "/generate", json.dumps(GOOD).encode())
    assert status == 200, text
    assert len(json.loads(text)["output_ids"]) == 1


def _norm(url: str) -> list:
    status, text = _call(url, "/get_weights_by_name", json.dumps({"name": NORM}).encode())
    assert status == 200, text
    return json.loads(text)


DIGITS = b"1" * 5000
BAD_BODIES = [
    ("nested_array", b"[" * 100_000 + b"]" * 100_000, "nests JSON arrays/objects too deeply"),
    ("nested_in_a_field", b'{"input_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}", "too deeply"),
    ("nested_below_the_parser_limit", b'{"sampling_params": {"stop": ' + b"[" * 40 + b"]" * 40 + b"}}",
     "field 'sampling_params.stop[0]"),
    ("5000_digit_token", b'{"input_ids": [' + DIGITS + b"]}", "field 'input_ids[0]' is an integer of 5000 digits"),
    ("5000_digit_top_k", b'{"input_ids": [5], "sampling_params": {"top_k": -' + DIGITS + b"}}",
     "field 'sampling_params.top_k' is an integer of 5000 digits"),
    ("5000_digits_then_nested", b'{"input_ids": [' + DIGITS + b'], "rid": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     "too deeply"),
    ("lone_surrogate_text", b'{"text": "abc\\ud800def"}', "field 'text' holds a lone UTF-16 surrogate"),
    ("lone_surrogate_rid", b'{"input_ids": [5], "rid": "\\udfff"}', "field 'rid' holds a lone UTF-16 surrogate"),
    ("lone_surrogate_key", b'{"input_ids": [5], "\\ud834": 1}', "lone UTF-16 surrogate"),
    ("not_utf8", b'{"text": "\xc3\x28"}', "not valid JSON"),
]


@pytest.mark.parametrize("raw, needle", [case[1:] for case in BAD_BODIES], ids=[case[0] for case in BAD_BODIES])
def test_a_body_no_parser_or_encoder_takes_is_400_naming_the_field(server, raw, needle):
    status, text = _call(server.url, "/generate", raw)
    assert status == 400, text
    assert needle in _message(text)
    _good_request_works(server.url)


def test_the_same_bodies_on_a_control_route_are_400(server):
    for _, raw, needle in BAD_BODIES[:6]:
        status, text = _call(server.url, "/update_weight_version", raw)
        assert status == 400 and needle in _message(text), text
    status, text = _call(server.url, "/update_weights_from_disk", b'{"model_path": "/tmp/\\ud800"}')
    assert status == 400 and "field 'model_path' holds a lone UTF-16 surrogate" in _message(text), text
    shapes = {"names": [NORM], "dtypes": ["float32"], "shapes": [[2**70]]}   # torch.empty: TypeError, a 500
    status, text = _call(server.url, "/update_weights_from_distributed", json.dumps(shapes).encode())
    assert status == 400 and "field 'shapes'" in _message(text), text


def test_a_non_numeric_query_parameter_is_400_naming_it(server):
    status, text = _call(server.url, f"/get_weights_by_name?name={NORM}&truncate_size=abc", method="GET")
    assert status == 400 and "query parameter 'truncate_size' must be an integer" in _message(text), text
    status, text = _call(server.url, f"/get_weights_by_name?name={NORM}&truncate_size=3", method="GET")
    assert status == 200 and len(json.loads(text)) == 3, text


def test_a_truncated_or_missing_model_is_400_with_success_false_and_the_old_weights_stay(server, tiny_model_dir,
                                                                                         tmp_path):
    """A directory whose first file is good (a changed model.norm.weight) and whose second is cut
    short: the read fails on the second, so not even the first file's tensor is installed."""
    import torch
    from safetensors.torch import save_file

    before = _norm(server.url)
    save_file({NORM: torch.tensor(before, dtype=torch.float32) + 1.0}, str(tmp_path / "a.safetensors"))
    (original,) = Path(tiny_model_dir).glob("*.safetensors")
    data = original.read_bytes()
    (tmp_path / "b.safetensors").write_bytes(data[: len(data) - 100])
    replies = [_call(server.url, "/update_weights_from_disk", json.dumps({"model_path": str(path)}).encode())
               for path in (tmp_path, tmp_path / "missing", tmp_path / "a.safetensors")]
    for (status, text), needle in zip(replies, ["b.safetensors: not a readable safetensors file",
                                                "is not a directory", "is not a directory"]):
        body = json.loads(text)
        assert status == 400 and body["success"] is False and needle in body["message"], text
        assert "The old weights stay." in body["message"]
    assert _norm(server.url) == before
    _good_request_works(server.url)


def test_a_hung_weight_file_never_stops_health_or_generation(server, tiny_model_dir, tmp_path):
    """A FIFO blocks open() as a hung network mount would: the update fails after the read timeout
    with success false, while /health and /generate answer throughout; a second disk update is
    refused while the first read is still blocked; once the file unblocks, updates work again."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    before = _norm(server.url)
    body = json.dumps({"model_path": str(tmp_path)}).encode()

    async def scenario():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            update = asyncio.create_task(session.post(server.url + "/update_weights_from_disk", data=body))
            await asyncio.sleep(0.5)   # the read has started (or the update answered already: asserted below)
            during = {"update_done_before_probes": update.done()}
            async with session.get(server.url + "/health") as reply:
                during["health"] = reply.status
            async with session.post(server.url + "/generate", json=GOOD) as reply:
                during["generate"] = reply.status
            async with session.post(server.url + "/update_weights_from_disk", data=body) as reply:
                during["second"] = (reply.status, await reply.json())
            reply = await update
            return during, reply.status, await reply.json()

    during, status, reply = asyncio.run(scenario())
    assert during == {"update_done_before_probes": False, "health": 200, "generate": 200,
                      "second": (400, during["second"][1])}
    assert "has not finished (a hung file or mount?)" in during["second"][1]["message"]
    assert status == 400 and reply["success"] is False
    assert f"did not finish within {READ_TIMEOUT_S} s" in reply["message"] and "The old weights stay." in reply["message"]
    assert _norm(server.url) == before
    _unblock(fifo)
    _good_request_works(server.url)
    # the blocked reader has ended (it read garbage): a good update goes through again
    good = json.dumps({"model_path": str(tiny_model_dir)}).encode()
    for _ in range(100):
        status, text = _call(server.url, "/update_weights_from_disk", good)
        if "has not finished" not in text:
            break
        threading.Event().wait(0.1)
    assert status == 200 and json.loads(text)["success"] is True, text


def _unblock(fifo: Path) -> None:
    """Open the FIFO's writing end so the server's blocked open() returns (it then reads garbage)."""
    fd = os.open(fifo, os.O_WRONLY)
    os.write(fd, b"not safetensors")
    os.close(fd)


@pytest.mark.parametrize("rank_offset, world_size", [(0, 1), (0, 2), (-1, 2), (2, 2)])
def test_a_group_layout_that_does_not_make_the_server_a_receiver_is_refused(server, rank_offset, world_size):
    before = _norm(server.url)
    body = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": "self_sender", "backend": "gloo"}
    status, text = _call(server.url, "/init_weights_update_group", json.dumps(body).encode())
    assert status == 400, text
    message = _message(text)
    assert "\n" not in message and ("rank_offset" in message)
    assert _norm(server.url) == before


def test_a_receive_as_the_groups_source_is_refused_before_any_bytes_are_installed():
    """Defence in depth behind the layout check: a group in which this server is rank 0 (formed
    in-process here, world size 1) never reaches the load: the receive is refused with one line."""
    from types import SimpleNamespace

    from parallel.distributed import free_port
    from rollout.engines.reference_server.weight_group import destroy_weight_update_group, init_weight_update_group
    from rollout.engines.reference_server.weight_updates import _receive_all

    group = init_weight_update_group("127.0.0.1", free_port(), 0, 1, "source_test", "gloo", timeout_s=30)
    try:
        state = SimpleNamespace(groups={"source_test": group})
        with pytest.raises(RuntimeError, match="rank 0 of the group, the broadcast's source") as err:
            _receive_all(state, [NORM], ["float32"], [[4]], "source_test", None)
    finally:
        destroy_weight_update_group(group)
    assert "\n" not in str(err.value) and "The old weights stay" in str(err.value)


def test_a_broadcast_cut_short_installs_nothing(server, tiny_model_dir):
    """The sender announces two tensors and sends only the first (a changed model.norm.weight), then
    goes quiet: the receive of the second times out, the call fails with one line, and the first
    tensor, although it arrived whole, is not installed either."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from parallel.distributed import free_port
    from rollout.engines.reference_server.weight_group import init_weight_update_group

    (weights,) = Path(tiny_model_dir).glob("*.safetensors")
    on_disk = load_file(str(weights))
    names = [NORM, "model.embed_tokens.weight"]
    before, port, box = _norm(server.url), free_port(), {}

    def sender():
        box["group"] = init_weight_update_group("127.0.0.1", port, 0, 2, "cut_short", "gloo", timeout_s=120)
        dist.broadcast(on_disk[NORM] + 1.0, src=0, group=box["group"])   # ... and never the second

    thread = threading.Thread(target=sender)
    thread.start()
    joined = _call(server.url, "/init_weights_update_group", json.dumps({
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "cut_short", "backend": "gloo"}).encode())
    try:
        assert joined[0] == 200, joined
        assert _call(server.url, "/begin_weight_update", b"{}")[0] == 200
        status, text = _call(server.url, "/update_weights_from_distributed", json.dumps({
            "names": names, "dtypes": [str(on_disk[n].dtype).replace("torch.", "") for n in names],
            "shapes": [list(on_disk[n].shape) for n in names], "group_name": "cut_short"}).encode())
        assert _call(server.url, "/end_weight_update", b"{}")[0] == 200
        thread.join(120)   # its one broadcast was received
        assert not thread.is_alive()
    finally:
        _call(server.url, "/destroy_weights_update_group", json.dumps({"group_name": "cut_short"}).encode())
        dist.destroy_process_group(box["group"])
    reply = json.loads(text)
    assert status == 400 and reply["success"] is False and "\n" not in reply["message"]
    assert "Failed to receive weights: receiving tensor 'model.embed_tokens.weight'" in reply["message"]
    assert _norm(server.url) == before == on_disk[NORM].float().tolist()[:len(before)]
    _good_request_works(server.url)


# ---- the property-based pass over /generate bodies ----

SURROGATES = st.sampled_from(["\ud800", "\udfff", "\udc80"])
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**30), max_value=10**30)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.lists(SURROGATES | st.text(max_size=3), max_size=3).map("".join))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
SAMPLING = st.dictionaries(st.sampled_from(sorted(SAMPLING_FIELDS) + ["max_new_tokens"] * 3 + ["bogus"]),
                           JSON | st.integers(min_value=1, max_value=3), max_size=5)
TOKENS = st.lists(st.integers(min_value=-3, max_value=120), max_size=6)
BODY = st.dictionaries(st.sampled_from(sorted(GENERATE_FIELDS) + ["input_ids"] * 3 + ["nope"]),
                       JSON | TOKENS | SAMPLING, max_size=6)


def _capped(body) -> bytes:
    """A generated body, with a small max_new_tokens where it would otherwise generate up to 128."""
    if isinstance(body, dict):
        params = body.get("sampling_params")
        if params is None or (isinstance(params, dict) and "max_new_tokens" not in params):
            body = {**body, "sampling_params": {**(params or {}), "max_new_tokens": 2}}
    return json.dumps(body).encode()


RAW = BODY.map(_capped) | JSON.map(lambda value: json.dumps(value).encode()) | st.binary(max_size=40)


@settings(max_examples=80, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(raw=RAW)
def test_random_generate_bodies_never_get_a_500(server, raw):
    status, text = _call(server.url, "/generate", raw)
    assert status in (200, 400), (status, text, raw[:200])
    if status == 400:
        assert _message(text) and "\n" not in _message(text).strip()


def test_after_the_random_bodies_the_server_is_alive_and_serves(server):
    assert server.process.poll() is None
    _good_request_works(server.url)
