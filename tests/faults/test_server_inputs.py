"""The reference server (`sao serve`) against bad input, lost clients, a dying scheduler and no api key.

Each bad request value is a 400 naming the field, and the same server then answers a good request
(the bug this guards: top_k = 2**64 once killed the scheduler thread for good while /health stayed
up). A scheduler failure ends the process with a non-zero code; a client that disconnects or times
out has its request aborted server-side (slot freed); without a key the weight and control routes
are refused unless --insecure; bad --max-context / busy port / bad host are one-line exit-2 errors.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from rollout.engines.reference_server import LocalServer, launch_local
from rollout.engines.sglang_launcher import wait_healthy

KEY = "fault-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
VOCAB = 105   # the tiny fixture model's
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    handle = launch_local(tiny_model_dir, api_key=KEY, timeout_s=300, seed=1,
                          extra_args=["--max-context", "1024", "--max-batch", "4"])
    yield handle
    handle.stop()


def _sp(**kw) -> dict:
    return {**GOOD, "sampling_params": {**GOOD["sampling_params"], **kw}}


def _body(**kw) -> dict:
    return {**GOOD, **kw}


BAD_SAMPLING = [
    ("top_k", 2**64), ("top_k", 2**31), ("top_k", 0), ("top_k", -2), ("top_k", 1.5), ("top_k", "5"), ("top_k", True),
    ("sampling_seed", 2**70), ("sampling_seed", -(2**63) - 1), ("sampling_seed", 2**63), ("sampling_seed", 1.5),
    ("sampling_seed", "7"),
    ("temperature", -1), ("temperature", "hot"), ("temperature", 10**400), ("temperature", [1]),
    ("top_p", 0), ("top_p", 1.5), ("top_p", -0.1), ("top_p", 10**400),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", "0"),
    ("max_new_tokens", 0), ("max_new_tokens", -1), ("max_new_tokens", 1.5), ("max_new_tokens", "10"),
    ("max_new_tokens", None),
    ("stop", ["x"]), ("stop", "x"), ("stop", 5), ("stop", [5]),
    ("stop_token_ids", "x"), ("stop_token_ids", [1.5]), ("stop_token_ids", [[1]]),
    ("n", 2), ("n", 0), ("n", "2"), ("n", 1.0),
    ("ignore_eos", "yes"), ("skip_special_tokens", 1), ("no_stop_trim", "no"),
    ("spaces_between_special_tokens", 0), ("frequency_penalty", 0.5),
]
BAD_BODY = [
    ("input_ids", []), ("input_ids", [-1]), ("input_ids", [VOCAB]), ("input_ids", [2**64]), ("input_ids", "abc"),
    ("input_ids", [[1, 2]]), ("input_ids", [1.0]), ("input_ids", [True]), ("input_ids", [5] * 1024),
    ("text", 5), ("rid", 5), ("rid", ["a"]), ("rid", "r" * 2000), ("extra_key", 5),
    ("return_logprob", "yes"), ("return_routed_experts", 1), ("routed_experts_start_len", -1),
    ("routed_experts_start_len", 99), ("routed_experts_start_len", 2**64), ("logprob_start_len", 0),
    ("logprob_start_len", "x"), ("logprob_start_len", -2), ("top_logprobs_num", 2), ("top_logprobs_num", -1),
    ("top_logprobs_num", "x"), ("stream", True), ("stream", "x"), ("log_metrics", "x"),
    ("return_text_in_logprobs", 3), ("sampling_params", []), ("sampling_params", "x"), ("frobnicate", 1),
]
NEEDLE = {"input_ids": "input", "text": "text"}   # "input is too long" names the input, not the key


def _post(url: str, path: str, data: bytes, headers: dict | None = None, timeout_s: float = 60) -> tuple[int, str]:
    request = urllib.request.Request(url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _message(text: str) -> str:
    return json.loads(text)["error"]["message"]


def _good_request_works(url: str, headers: dict | None = AUTH) -> None:
    status, text = _post(url, "/generate", json.dumps(GOOD).encode(), headers)
    assert status == 200, text
    assert len(json.loads(text)["output_ids"]) == 1


@pytest.mark.parametrize("field, value", BAD_SAMPLING, ids=[f"{f}={str(v)[:12]}" for f, v in BAD_SAMPLING])
def test_bad_sampling_value_is_400_naming_the_field(server, field, value):
    status, text = _post(server.url, "/generate", json.dumps(_sp(**{field: value})).encode(), AUTH)
    assert status == 400, text
    assert field in _message(text)
    _good_request_works(server.url)


@pytest.mark.parametrize("field, value", BAD_BODY, ids=[f"{f}={str(v)[:12]}" for f, v in BAD_BODY])
def test_bad_request_field_is_400_naming_the_field(server, field, value):
    status, text = _post(server.url, "/generate", json.dumps(_body(**{field: value})).encode(), AUTH)
    assert status == 400, text
    assert NEEDLE.get(field, field) in _message(text)
    _good_request_works(server.url)


@pytest.mark.parametrize("raw, needle", [
    (b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"), (b'"x"', "JSON object"),
    (b'{"input_ids": [5], "sampling_params": {"temperature": NaN}}', "temperature"),
    (b'{"input_ids": [5], "sampling_params": {"top_p": Infinity}}', "top_p"),
    (b'{"input_ids": [5], "sampling_params": {"min_p": -Infinity}}', "min_p"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_malformed_body_is_400(server, raw, needle):
    status, text = _post(server.url, "/generate", raw, AUTH)
    assert status == 400, text
    assert needle in _message(text)
    _good_request_works(server.url)


def test_seed_and_top_k_at_their_limits_are_served(server):
    """SGLang's inclusive bounds are accepted (a top_k beyond the vocabulary keeps every token)."""
    for extra in ({"sampling_seed": 2**63 - 1}, {"sampling_seed": -(2**63)}, {"top_k": 2**31 - 1},
                  {"min_p": 1.0}, {"temperature": None, "top_p": None, "top_k": None, "n": 1}):
        status, text = _post(server.url, "/generate", json.dumps(_sp(**extra)).encode(), AUTH)
        assert status == 200, (extra, text)


@pytest.mark.parametrize("path, body, needle", [
    ("/abort_request", {"rid": 5}, "rid"), ("/abort_request", {"abort_all": "yes"}, "abort_all"),
    ("/pause_generation", {"mode": "later"}, "mode"), ("/pause_generation", {"mode": 3}, "mode"),
    ("/weights_checker", {"skip_tensor_list": [1]}, "skip_tensor_list"),
    ("/flush_cache?timeout=abc", {}, "timeout"), ("/flush_cache?timeout=inf", {}, "timeout"),
    ("/flush_cache?timeout=-1", {}, "timeout"),
])
def test_bad_control_values_are_400(server, path, body, needle):
    status, text = _post(server.url, path, json.dumps(body).encode(), AUTH)
    assert status == 400, text
    assert needle in _message(text)
    _good_request_works(server.url)


def test_duplicate_rid_in_flight_is_400(server):
    async def scenario():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            first = asyncio.create_task(session.post(server.url + "/generate", json=_long("dup")))
            await _wait_info(session, server.url, lambda s: s["running_output_tokens"] >= 2)
            async with session.post(server.url + "/generate", json=_long("dup")) as second:
                dup = (second.status, await second.text())
            await session.post(server.url + "/abort_request", json={"rid": "dup"})
            reply = await first
            return dup, reply.status, (await reply.json())["meta_info"]["finish_reason"]["type"]

    (status, text), first_status, finish = asyncio.run(scenario())
    assert status == 400 and "Duplicate request ID detected: dup" in _message(text)
    assert first_status == 200 and finish == "abort"
    _good_request_works(server.url)


def _long(rid: str) -> dict:
    return {"rid": rid, "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 1.0}}


async def _info(session, url: str) -> dict:
    async with session.get(url + "/sao_server_info") as reply:
        return (await reply.json())["scheduler"]


async def _wait_info(session, url: str, ok, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = await _info(session, url)
        if ok(info):
            return info
        await asyncio.sleep(0.02)
    raise AssertionError(f"server state never reached the expected one: {info}")


@pytest.mark.parametrize("how", ["disconnect", "client_timeout"])
def test_a_client_that_goes_away_has_its_request_aborted(server, how):
    """The request is paused in place mid-generation (so it cannot finish on its own), then its
    client disconnects or times out: the server aborts it, frees the slot and counts it."""
    async def scenario():
        async with aiohttp.ClientSession(headers=AUTH) as control:
            before = (await _info(control, server.url))["cancelled"]
            timeout = aiohttp.ClientTimeout(total=3 if how == "client_timeout" else None)
            client = aiohttp.ClientSession(headers=AUTH, timeout=timeout)
            task = asyncio.create_task(client.post(server.url + "/generate", json=_long(f"gone-{how}")))
            # (a machine so slow that the client timed out first has cancelled it already: fine too)
            await _wait_info(control, server.url, lambda s: s["running_output_tokens"] >= 3 or s["cancelled"] > before)
            await control.post(server.url + "/pause_generation", json={"mode": "in_place"})
            if how == "disconnect":
                task.cancel()
                await client.close()
            else:
                with pytest.raises(asyncio.TimeoutError):
                    await task
                await client.close()
            info = await _wait_info(control, server.url, lambda s: s["cancelled"] > before)
            await control.post(server.url + "/continue_generation", json={})
            return info, before

    info, before = asyncio.run(scenario())
    assert info["cancelled"] == before + 1 and info["running"] == 0 and info["waiting"] == 0
    _good_request_works(server.url)


# ---- no api key: control routes refused unless --insecure ----

def test_the_api_key_is_not_on_the_servers_command_line(server):
    """launch_local hands the key over in $SAO_API_KEY: `ps` shows argv to every user."""
    cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    assert b"rollout.engines.reference_server" in cmdline
    assert KEY.encode() not in cmdline and b"--api-key" not in cmdline
    status, text = _post(server.url, "/flush_cache", b"", {"Authorization": "Bearer wrong"})
    assert status == 401 and "API key" in _message(text)


CONTROL = ["/pause_generation", "/continue_generation", "/flush_cache", "/abort_request", "/update_weights_from_disk",
           "/update_weights_from_distributed", "/init_weights_update_group", "/destroy_weights_update_group",
           "/update_weight_version", "/begin_weight_update", "/end_weight_update", "/get_weights_by_name",
           "/weights_checker"]


def test_without_a_key_control_routes_are_403_and_generation_is_served(tiny_model_dir):
    with launch_local(tiny_model_dir, timeout_s=300) as srv:
        replies = {path: _post(srv.url, path, b"{}") for path in CONTROL}
        _good_request_works(srv.url, headers=None)
        log = srv.log_tail(20000)
    for path, (status, text) in replies.items():
        assert status == 403, (path, text)
        assert "--insecure" in _message(text) and "SAO_API_KEY" in _message(text), path
    assert "no api key: the weight and control routes answer 403" in log


def _spawn(model_dir, code: str, *flags: str) -> LocalServer:
    """`python -c code` as a reference server (flags as `sao serve`'s), once /health is 200."""
    workdir = Path(tempfile.mkdtemp(prefix="sao_fault_"))
    port_file, log_path = workdir / "port", workdir / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "SAO_API_KEY"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-c", code, "--model", str(model_dir), "--port", "0",
                                    "--port-file", str(port_file), "--max-context", "512", *flags],
                                   stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    srv = LocalServer(url="", port=0, api_key="", process=process, log_path=log_path)
    deadline = time.monotonic() + 300
    while not port_file.exists():
        assert process.poll() is None and time.monotonic() < deadline, srv.log_tail()
        time.sleep(0.1)
    srv.port = int(port_file.read_text())
    srv.url = f"http://127.0.0.1:{srv.port}"
    wait_healthy(srv, 300, label="reference server", poll_s=0.1)
    return srv


CRASH_ON_BOOM = """
import sys
from rollout.engines.reference_server import scheduler
from rollout.engines.reference_server.__main__ import main
real_step = scheduler.Scheduler._step
def step(self):
    if any(r.rid == "boom" for r in self.running):
        raise RuntimeError("injected scheduler fault")
    return real_step(self)
scheduler.Scheduler._step = step
sys.exit(main(sys.argv[1:]))
"""


def test_insecure_serves_control_and_a_scheduler_failure_exits_non_zero(tiny_model_dir):
    """--insecure serves the control routes without a key; then a step that raises ends the process
    with a non-zero code (the request that hit it gets a 500) instead of leaving /health up."""
    srv = _spawn(tiny_model_dir, CRASH_ON_BOOM, "--insecure")
    try:
        flushed = _post(srv.url, "/flush_cache", b"")
        paused = _post(srv.url, "/pause_generation", json.dumps({"mode": "in_place"}).encode())
        resumed = _post(srv.url, "/continue_generation", b"{}")
        _good_request_works(srv.url, headers=None)
        boom = _post(srv.url, "/generate", json.dumps({**GOOD, "rid": "boom"}).encode())
        code = srv.process.wait(120)
    finally:
        srv.stop()
    assert flushed[0] == 200 and paused[0] == 200 and resumed[0] == 200, (flushed, paused, resumed)
    assert "--insecure: anyone who can reach" in srv.log_tail(20000)
    assert boom[0] == 500 and "injected scheduler fault" in boom[1]
    assert code != 0
    last = srv.log_tail(20000).strip().splitlines()[-1]
    assert last == "reference server: scheduler failed: RuntimeError: injected scheduler fault"


# ---- CLI: one-line errors, exit 2, before the model loads ----

def _serve(tiny_model_dir, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SAO_API_KEY"}
    return subprocess.run([sys.executable, "-m", "sao_megatron.cli.main", "serve", "--model", str(tiny_model_dir),
                           "--api-key", "k", *flags], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(REPO))


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("flags, needle", [
    (["--max-context", "-5"], "--max-context -5"),
    (["--max-context", "1"], "--max-context 1"),
    (["--max-context", "99999999"], "exceeds the model's max_position_embeddings"),
    (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' does not resolve"),
    (["--host", "192.0.2.1"], "cannot listen on 192.0.2.1"),      # TEST-NET: not an address of this machine
    (["--port", "70000"], "--port 70000 out of range"),
    (["--port", "BUSY"], "cannot listen on 127.0.0.1:"),
    (["--threads", "-1"], "--threads -1"),
    (["--weight-sync-timeout-s", "0"], "--weight-sync-timeout-s"),
])
def test_bad_flags_are_one_line_errors(tiny_model_dir, busy_port, flags, needle):
    flags = [str(busy_port) if f == "BUSY" else f for f in flags]
    done = _serve(tiny_model_dir, *flags)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("sao serve: ") and needle in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_prompt_plus_max_new_tokens_past_the_context_is_refused_as_sglang_does(server):
    """SGLang 0.5.23 answers 400 when prompt + an explicit max_new_tokens exceeds the context (its
    text, pinned in test_sglang_behaviour_contract.py); exactly the context is served, and without
    max_new_tokens the request runs until the context ends (`length`)."""
    prompt = [5] * 1000                                    # the fixture server's --max-context is 1024
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 25, "temperature": 0, "ignore_eos": True}}
    status, text = _post(server.url, "/generate", json.dumps(body).encode(), AUTH)
    assert status == 400 and set(json.loads(text)) == {"error"}
    assert _message(text) == ("Requested token count exceeds the model's maximum context length of 1024 tokens. "
                              "You requested a total of 1025 tokens: 1000 tokens from the input messages and 25 "
                              "tokens for the completion. Please reduce the number of tokens in the input messages "
                              "or the completion to fit within the limit.")
    body["sampling_params"]["max_new_tokens"] = 24
    status, text = _post(server.url, "/generate", json.dumps(body).encode(), AUTH)
    assert status == 200 and len(json.loads(text)["output_ids"]) == 24, text
    del body["sampling_params"]["max_new_tokens"]
    status, text = _post(server.url, "/generate", json.dumps(body).encode(), AUTH)
    reply = json.loads(text)
    assert status == 200 and reply["meta_info"]["finish_reason"]["type"] == "length", text
    assert len(reply["output_ids"]) == 24
    _good_request_works(server.url)
