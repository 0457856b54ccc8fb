"""The reference server's HTTP routes: SGLang 0.5.23's paths, bodies and status codes (docs/engines.md).

Every route except /health* needs ``Authorization: Bearer <api key>`` (401 otherwise), as SGLang
does with ``--api-key`` (utils/auth.py:96-102). Stricter than SGLang: a server started WITHOUT a key
serves only the SERVED_WITHOUT_KEY routes and answers 403 on the weight and control routes (update,
groups, pause, flush, abort, weight reads) unless it was started with ``--insecure``.
Client errors are 400 ``{"error": {"message": ...}}``; an unexpected server error is logged with
its traceback and answered 500, never hidden.
Route modules: generation (/generate), health (/health*), weight_updates (sessions, groups,
updates, weight reads), weights_checker; this one holds the rest and the route table.
GET /sao_server_info is ours, not SGLang's: what tests and benchmarks read about the server.
"""
from __future__ import annotations

import asyncio
import hmac
import math
import logging

from aiohttp import web

from . import weight_updates
from .generation import generate
from .health import health
from .http_io import error, on_scheduler, read_json
from .protocol import BadRequest, parse_optional
from .scheduler import PAUSE_MODES
from .state import ServerState
from .weights_checker import weights_checker

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/health_generate")
SERVED_WITHOUT_KEY = ("/generate", "/health", "/health_generate", "/model_info", "/sao_server_info")
NO_KEY = ("this server was started without an api key, so its weight and control routes are refused; "
          "restart it with $SAO_API_KEY set (or --api-key), or with --insecure on a trusted network")
_json = read_json   # the body reader route modules are handed
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. "
           "(When there are running or waiting requests, the operation will not be performed.)\n")
POLL_S = 0.02

__all__ = ["ServerState", "build_app"]


def _auth_middleware(state: ServerState):
    @web.middleware
    async def auth(request: web.Request, handler):
        if state.api_key and not request.path.startswith(OPEN_PATHS):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                return error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
        if not (state.api_key or state.insecure or request.path in SERVED_WITHOUT_KEY):
            return error(403, f"{request.path}: {NO_KEY}")
        try:
            return await handler(request)
        except BadRequest as err:
            return error(400, str(err))
        except web.HTTPException:
            raise
        except Exception as err:   # logged with traceback, answered 500: never hidden
            log.exception("handler %s failed", request.path)
            return error(500, f"{type(err).__name__}: {err}")
    return auth


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_auth_middleware(state)], client_max_size=64 * 2**20)
    r = app.router
    r.add_post("/generate", lambda q: generate(state, q))
    r.add_put("/generate", lambda q: generate(state, q))
    r.add_get("/health", lambda q: health(state, q))
    r.add_get("/health_generate", lambda q: health(state, q))
    r.add_get("/model_info", lambda q: model_info(state, q))
    r.add_get("/sao_server_info", lambda q: sao_server_info(state, q))
    r.add_get("/v1/loads", lambda q: loads(state, q))
    for method in ("GET", "POST"):
        r.add_route(method, "/flush_cache", lambda q: flush_cache(state, q))
        r.add_route(method, "/weights_checker", lambda q: weights_checker(state, q, _json))
    r.add_post("/abort_request", lambda q: abort_request(state, q))
    r.add_post("/pause_generation", lambda q: pause_generation(state, q))
    r.add_post("/continue_generation", lambda q: continue_generation(state, q))
    weight_updates.add_routes(r, state)
    return app


async def model_info(state: ServerState, request: web.Request) -> web.Response:
    """Exactly SGLang's keys (entrypoints/http_server.py:812-846); nothing of ours."""
    cfg = state.runner.config
    return web.json_response({
        "model_path": state.model_path, "served_model_name": state.model_path,
        "tokenizer_path": state.runner.model_dir, "is_generation": True, "preferred_sampling_params": None,
        "weight_version": str(state.scheduler.version), "load_format": state.load_format,
        "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
        "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None),
    })


async def sao_server_info(state: ServerState, request: web.Request) -> web.Response:
    """Ours, not SGLang's (a trainer must not need it): model shape, limits and live scheduler state."""
    runner = state.runner
    return web.json_response({
        "num_layers": runner.num_layers, "num_moe_layers": runner.num_moe_layers, "moe_topk": runner.top_k,
        "moe_layer_ids": runner.router_layers, "max_context": runner.max_context, "max_batch": runner.max_batch,
        "dtype": str(runner.dtype).replace("torch.", ""), "device": str(runner.device), "tp": state.tp_ranks.tp,
        "quantization": getattr(state, "quantization", "") or None, "status": state.status, "weight_update_session": state.session,
        "scheduler": {**state.scheduler.stats(), "paused": state.gate.paused,
                      "scheduler_paused": state.scheduler.paused, "held_by_pause": state.gate.held},
    })


async def loads(state: ServerState, request: web.Request) -> web.Response:
    """SGLang 0.5.23's /v1/loads (entrypoints/v1_loads.py:96), its core fields that this server knows
    (managers/load_snapshot.py:196): running and waiting requests, and as token_usage the share of KV slots
    in use (one slot per running request here); no generation throughput is measured (0)."""
    stats, slots = state.scheduler.stats(), max(int(state.runner.max_batch), 1)
    return web.json_response({"loads": [{
        "dp_rank": 0, "num_running_reqs": stats["running"], "num_waiting_reqs": stats["waiting"],
        "max_running_requests": slots, "token_usage": stats["running"] / slots, "gen_throughput": 0.0}]})


async def flush_cache(state: ServerState, request: web.Request) -> web.Response:
    """SGLang http_server.py:1025-1040 + scheduler_components/flush_wrapper.py: refused (400) unless the
    scheduler is idle; ``?timeout=S`` waits up to S seconds for idle first."""
    try:
        timeout_s = float(request.query.get("timeout", 0.0))
    except ValueError:
        raise BadRequest(f"query parameter 'timeout' must be a number, got {request.query['timeout']!r}") from None
    if not 0 <= timeout_s < math.inf:
        raise BadRequest(f"query parameter 'timeout' must be a finite number >= 0, got {timeout_s}")
    if state.flush_pending:
        return web.Response(status=400, text="Another flush_cache is already in progress.")
    message = ""
    if timeout_s <= 0:
        ok = await on_scheduler(state, state.scheduler.flush_cache)
    else:
        state.flush_pending = True
        try:
            ok, message = await _flush_when_idle(state, timeout_s)
        finally:
            state.flush_pending = False
    return web.Response(status=200, text=FLUSHED) if ok else \
        web.Response(status=400, text=message or "Flush cache failed.\n")


async def _flush_when_idle(state: ServerState, timeout_s: float) -> tuple[bool, str]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        flushed = await on_scheduler(state, lambda: state.scheduler.is_fully_idle() and state.scheduler.flush_cache())
        if flushed:
            return True, ""
        if asyncio.get_running_loop().time() >= deadline:
            return False, "Timed out waiting for idle state."
        await asyncio.sleep(POLL_S)


async def abort_request(state: ServerState, request: web.Request) -> web.Response:
    body = await read_json(request)
    rid = parse_optional(body, "rid", str, "")
    abort_all = parse_optional(body, "abort_all", bool, False)
    await on_scheduler(state, lambda: state.scheduler.abort(None if abort_all else rid))
    return web.Response(status=200)


async def pause_generation(state: ServerState, request: web.Request) -> web.Response:
    """SGLang tokenizer_manager.py:2267-2280: new requests wait from now on; ``abort`` aborts until
    nothing holds the update lock, the other modes pause the scheduler (scheduler.py:5817)."""
    mode = parse_optional(await read_json(request), "mode", str, "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"field 'mode' must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    async with state.gate.cond:
        state.gate.paused = True
        if mode != "abort":
            await on_scheduler(state, lambda: state.scheduler.pause(mode))
        else:
            while True:
                await on_scheduler(state, lambda: state.scheduler.abort(None, "aborted by pause_generation(mode=abort)"))
                if not state.gate.lock.locked:
                    break
                await asyncio.sleep(POLL_S)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(state: ServerState, request: web.Request) -> web.Response:
    await read_json(request)
    async with state.gate.cond:
        state.gate.paused = False
        await on_scheduler(state, state.scheduler.resume)
        state.gate.cond.notify_all()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})
