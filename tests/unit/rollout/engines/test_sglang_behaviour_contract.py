"""Behaviour contract: what the trainer relies on in SGLang 0.5.23, pinned from the wheel's source.

test_sglang_contract.py checks names (routes, fields); this file pins behaviour: each test reads the
code that decides it (AST / text of the pinned wheel, never importing SGLang) and fails if an SGLang
upgrade changes it. Where the reference server copies a message or a constant, the test also checks
that our copy is SGLang's (the servers' behaviour itself: test_reference_server_sglang_behaviour.py).
Paths are relative to sglang/srt/.
"""
from __future__ import annotations

import ast

import pytest

from sglang_wheel import HTTP, IO_STRUCT, class_defaults, function, model_info_keys, refusal_message, source, \
    strings_in

from rollout.engines.reference_server import health, weight_updates
from rollout.engines.reference_server.state import health_check_timeout_s

UPDATER = "managers/scheduler_components/weight_updater.py"
RUNNER_UPDATER = "model_executor/model_runner_components/weight_updater.py"
MIXIN = "managers/tokenizer_control_mixin.py"
TOKENIZER = "managers/tokenizer_manager.py"
SCHEDULER = "managers/scheduler.py"

# /model_info's key set (http_server.py model_info); a change here is a change the client must review
MODEL_INFO_KEYS = {"model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
                   "weight_version", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
                   "has_image_understanding", "has_audio_understanding", "model_type", "architectures"}


def code(path: str, qualname: str) -> str:
    return ast.unparse(function(path, qualname))


def route_methods(fn: ast.AST) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for deco in fn.decorator_list:
        if isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.args:
            kind, path = deco.func.attr, deco.args[0].value
            methods = {kind.upper()} if kind in ("get", "post") else \
                {m.value for kw in deco.keywords if kw.arg == "methods" for m in kw.value.elts}
            out.setdefault(path, set()).update(methods)
    return out


def test_distributed_update_is_refused_outside_a_session_before_any_receive():
    fn = function(UPDATER, "SchedulerWeightUpdaterManager.update_weights_from_distributed")
    check = next(s for s in fn.body if isinstance(s, ast.If))
    assert ast.unparse(check.test) == "self._session is None" and isinstance(check.body[0], ast.Return)
    receive = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Attribute)
               and n.attr == "receive_weights_from_distributed"]
    assert receive and check.lineno < min(receive), "the session check no longer precedes the receive"
    message = refusal_message(UPDATER, "SchedulerWeightUpdaterManager.update_weights_from_distributed")
    assert message == weight_updates.NO_SESSION
    assert "HTTPStatus.BAD_REQUEST" in code(HTTP, "update_weights_from_distributed")


def test_begin_and_end_open_and_close_one_session():
    for path in ("/begin_weight_update", "/end_weight_update"):
        name = path.strip("/")
        assert route_methods(function(HTTP, name)) == {path: {"POST"}}
        assert "HTTPStatus.BAD_REQUEST" in code(HTTP, name)      # a refusal is a 400
    assert class_defaults(IO_STRUCT, "BeginWeightUpdateReqInput") == {"selector": "all"}
    assert class_defaults(IO_STRUCT, "EndWeightUpdateReqInput") == {}
    begin = function(UPDATER, "SchedulerWeightUpdaterManager.begin_weight_update")
    assert ast.unparse(next(s for s in begin.body if isinstance(s, ast.If)).test) == "self._session is not None"
    assert refusal_message(UPDATER, "SchedulerWeightUpdaterManager.begin_weight_update") == weight_updates.SESSION_OPEN
    assert refusal_message(UPDATER, "SchedulerWeightUpdaterManager.end_weight_update") == \
        weight_updates.NO_SESSION_TO_END
    assert "self._session = None" in code(UPDATER, "SchedulerWeightUpdaterManager.end_weight_update")
    selectors = code(UPDATER, "_parse_runner_selector")
    assert all(repr(s) in selectors for s in weight_updates.SELECTORS)


def test_disk_update_needs_no_session_and_every_update_flushes_by_default():
    assert "_session" not in code(UPDATER, "SchedulerWeightUpdaterManager.update_weights_from_disk")
    assert class_defaults(IO_STRUCT, "UpdateWeightFromDiskReqInput")["flush_cache"] is True
    assert class_defaults(IO_STRUCT, "UpdateWeightsFromDistributedReqInput")["flush_cache"] is True
    flush_after = function(UPDATER, "SchedulerWeightUpdaterManager.flush_cache_after_weight_update")
    assert weight_updates.NOT_FLUSHED in strings_in(flush_after)
    for method in ("update_weights_from_disk", "update_weights_from_distributed"):
        assert "self.flush_cache_after_weight_update(" in code(UPDATER, f"SchedulerWeightUpdaterManager.{method}")


def test_flush_is_refused_unless_idle_and_an_in_place_pause_keeps_the_running_batch():
    assert "self.is_fully_idle(ignore_waiting=self._engine_paused)" in code(SCHEDULER, "Scheduler.flush_cache")
    assert "self.running_batch.is_empty()" in code(SCHEDULER, "Scheduler.is_fully_idle")
    pause = function(SCHEDULER, "Scheduler.pause_generation")
    in_place = next(s for s in pause.body if isinstance(s, ast.If) and "in_place" in ast.unparse(s.test))
    assert isinstance(in_place.body[-1], ast.Return)              # returns with the running batch intact
    assert "self.running_batch.reqs = []" in ast.unparse(pause)    # retract empties it
    flush = function(HTTP, "flush_cache")
    assert route_methods(flush) == {"/flush_cache": {"GET", "POST"}}
    assert "Flush cache failed.\n" in strings_in(flush) and "HTTPStatus.BAD_REQUEST" in ast.unparse(flush)
    wrapper = source("managers/scheduler_components/flush_wrapper.py")
    assert "Timed out waiting for idle state." in wrapper and "Another flush_cache is already in progress." in wrapper


def test_health_generates_one_token_and_new_requests_wait_while_paused(monkeypatch):
    monkeypatch.delenv("SGLANG_HEALTH_CHECK_TIMEOUT", raising=False)
    fn = function(HTTP, "health_generate")
    assert route_methods(fn) == {"/health": {"GET"}, "/health_generate": {"GET"}}
    text = ast.unparse(fn)
    assert "sampling_params = {'max_new_tokens': 1, 'temperature': 0.0}" in text
    assert "input_ids=[0]" in text and "HEALTH_CHECK_TIMEOUT" in text
    assert "ServerStatus.Starting:\n        return Response(status_code=503)" in text
    probe = health._probe("x", [0], 1)
    assert (probe.input_ids, probe.params.max_new_tokens, probe.params.temperature) == ([0], 1, 0.0)
    timeout = next(s for s in ast.parse(source(HTTP)).body if isinstance(s, ast.Assign)
                   and getattr(s.targets[0], "id", "") == "HEALTH_CHECK_TIMEOUT")
    assert ast.unparse(timeout.value) == "int(os.getenv('SGLANG_HEALTH_CHECK_TIMEOUT', 20))"
    assert health_check_timeout_s() == ast.literal_eval(timeout.value.args[0].args[1])
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)" in source("environ.py")
    assert "await self.is_pause_cond.wait_for(lambda: not self.is_pause)" in \
        code(TOKENIZER, "TokenizerManager.generate_request")
    assert "is_health_check_generate_req(recv_req) and (not self.is_fully_idle(for_health_check=True))" in \
        ast.unparse(ast.parse(source(SCHEDULER)))                  # busy: the probe is skipped


def test_unpaused_updates_wait_for_in_flight_requests():
    assert "async with self.model_update_lock.reader_lock:" in code(TOKENIZER, "TokenizerManager.generate_request")
    for method in ("update_weights_from_distributed", "_weight_update_session_call"):
        text = code(MIXIN, f"TokenizerControlMixin.{method}")
        assert "if not is_paused:" in text and "self.model_update_lock.writer_lock" in text, method
    disk = code(TOKENIZER, "TokenizerManager.update_weights_from_disk")
    assert "self.model_update_lock.writer_lock if not is_paused else nullcontext()" in disk
    assert "self._waiting_writers > 0" in code("utils/aio_rwlock.py", "RWLock.acquire_reader")   # writer first


def test_model_info_has_exactly_these_keys():
    assert model_info_keys() == MODEL_INFO_KEYS


def test_routed_experts_cover_every_hidden_layer_by_global_layer_id():
    init = code("state_capturer/routed_experts.py", "RoutedExpertsCapturer.__init__")
    assert "num_layers = model_config.hf_text_config.num_hidden_layers" in init
    assert "topk_size = model_config.hf_text_config.num_experts_per_tok" in init
    assert "self.buffer[:batch, layer_id, :] = topk_indices" in code("state_capturer/base.py", "BaseDeviceCache.capture")
    assert "self.buffer = torch.zeros(" in code("state_capturer/base.py", "BaseDeviceCache.__init__")
    topk = function("layers/moe/topk.py", "TopK")
    init_args = function("layers/moe/topk.py", "TopK.__init__").args
    layer_id = init_args.kwonlyargs[[a.arg for a in init_args.kwonlyargs].index("layer_id")]
    assert ast.unparse(layer_id.annotation) == "int"
    assert init_args.kw_defaults[init_args.kwonlyargs.index(layer_id)] is None     # required, no default
    assert "global index of the owning layer" in ast.get_docstring(topk)


def test_each_tp_rank_joins_the_update_group_as_rank_offset_plus_tp_rank():
    init = function(RUNNER_UPDATER, "WeightUpdater.init_weights_update_group")
    assert "rank = rank_offset + self.tp_rank" in ast.unparse(init)
    group_call = next(n for n in ast.walk(init) if isinstance(n, ast.Call)
                      and getattr(n.func, "id", "") == "init_custom_process_group")
    assert {k.arg: ast.unparse(k.value) for k in group_call.keywords}["rank"] == "rank"
    assert "Succeeded to initialize custom process group." in strings_in(init)


def test_weights_checker_route_checksums():
    assert route_methods(function(HTTP, "check_weights")) == {"/weights_checker": {"GET", "POST"}}
    fields = class_defaults(IO_STRUCT, "CheckWeightsReqInput")
    assert fields == {"action": "checksum", "allow_quant_error": False, "skip_tensor_list": None, "selector": "all"}


def _render(node: ast.JoinedStr, names: dict[str, object]) -> str:
    """An f-string of SGLang's source with each `{expr}` replaced by names[expr]."""
    return "".join(str(part.value) if isinstance(part, ast.Constant) else str(names[ast.unparse(part.value)])
                   for part in node.values)


def _raised_messages(fn: ast.AST) -> list[ast.JoinedStr]:
    """The f-string messages of `raise ValueError(...)` (inline, or via `error_msg = f"..."`) in `fn`."""
    assigned = {n.targets[0].id: n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
                and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.JoinedStr)}
    out = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                getattr(node.exc.func, "id", "") == "ValueError" and node.exc.args:
            arg = node.exc.args[0]
            arg = assigned.get(arg.id, arg) if isinstance(arg, ast.Name) else arg
            if isinstance(arg, ast.JoinedStr):
                out.append(arg)
    return out


def test_a_request_longer_than_the_context_is_refused_with_400_in_sglangs_words():
    """SGLang refuses prompt >= context and prompt + an explicit max_new_tokens > context (no
    --allow-auto-truncate, the default: with it SGLang trims max_new_tokens instead); the reference
    server refuses both with the same text; the HTTP layer answers 400 {"error": {"message"}}."""
    from rollout.engines.reference_server import protocol

    fn = function(TOKENIZER, "TokenizerManager._validate_one_request")
    text = ast.unparse(fn)
    assert "if input_token_num >= self.context_len:" in text
    assert "self.validate_total_tokens and max_new_tokens is not None and " \
           "(max_new_tokens + input_token_num > _max_req_len)" in text
    assert "max_new_tokens = obj.sampling_params.get('max_new_tokens')" in text   # explicit only
    assert text.count("if self.allow_auto_truncate:") == 2                        # both checks can trim instead
    assert "self.validate_total_tokens = True" in code(TOKENIZER, "TokenizerManager.init_model_config")
    serving = ast.unparse(ast.parse(source("arg_groups/fields/serving.py")))
    assert "allow_auto_truncate: A[bool, " in serving and "instead of returning an error.'] = False" in serving
    names = {"input_token_num": 7, "self.context_len": 10, "total_tokens": 12, "max_new_tokens": 5}
    ours = [protocol.INPUT_TOO_LONG.format(input=7, context=10),
            protocol.TOTAL_TOO_LONG.format(context=10, total=12, input=7, new=5)]
    theirs = [_render(m, names) for m in _raised_messages(fn)
              if all(ast.unparse(v.value) in names for v in m.values if isinstance(v, ast.FormattedValue))]
    assert ours[0] in theirs and ours[1] in theirs, theirs
    assert "return _create_error_response(e)" in code(HTTP, "serve_generate_request")
    reply = code(HTTP, "_create_error_response")
    assert "{'error': {'message': str(e)}}" in reply and "HTTPStatus.BAD_REQUEST" in reply
    with pytest.raises(protocol.BadRequest) as refused:
        protocol.check_context(7, {"max_new_tokens": 5}, 10)
    assert str(refused.value) == ours[1]
    protocol.check_context(7, {"max_new_tokens": 3}, 10)     # exactly the context: served
    protocol.check_context(7, {}, 10)                        # no max_new_tokens: served (stops at the context)
