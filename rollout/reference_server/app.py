"""The reference server's HTTP routes: SGLang's paths, bodies and status codes (docs/engines.md).

Every route except /health* needs ``Authorization: Bearer <api key>`` (401 otherwise), as SGLang
does with ``--api-key``. Client errors are 400 ``{"error": {"message": ...}}``; an unexpected server
error is logged with its traceback and answered 500, never hidden.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
from pathlib import Path
from typing import Optional

from aiohttp import web

from .protocol import BadRequest, build_response, parse_generate, parse_optional
from .scheduler import PAUSE_MODES, Request, Scheduler
from .weight_group import destroy_weight_update_group, init_weight_update_group, receive_tensors
from .weights import UnknownWeightError, WeightMap, parse_dtype

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/health_generate")


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class ServerState:
    """What the handlers share: the scheduler, the weight map, the update groups, a worker thread."""

    def __init__(self, scheduler: Scheduler, tokenizer, api_key: str, weight_sync_timeout_s: float):
        self.scheduler = scheduler
        self.runner = scheduler.runner
        self.weights = WeightMap(self.runner.model)
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.groups: dict[str, object] = {}
        # one thread for group formation and broadcast receives, so they keep the trainer's order
        # and never block generation (only the final in-place copy runs on the scheduler thread)
        self.transfer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sao-weights")
        eos = self.runner.config.eos_token_id
        self.eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def _auth_middleware(state: ServerState):
    @web.middleware
    async def auth(request: web.Request, handler):
        if state.api_key and not request.path.startswith(OPEN_PATHS):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                return error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
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


async def _json(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"request body is not valid JSON: {err}") from None
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


async def _on_scheduler(state: ServerState, fn):
    return await asyncio.wrap_future(state.scheduler.call(fn))


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_auth_middleware(state)], client_max_size=64 * 2**20)
    r = app.router
    r.add_post("/generate", lambda q: generate(state, q))
    r.add_put("/generate", lambda q: generate(state, q))
    r.add_get("/health", lambda q: health(state, q))
    r.add_get("/health_generate", lambda q: health(state, q))
    r.add_get("/model_info", lambda q: model_info(state, q))
    for method in ("GET", "POST"):
        r.add_route(method, "/flush_cache", lambda q: flush_cache(state, q))
        r.add_route(method, "/get_weights_by_name", lambda q: get_weights_by_name(state, q))
    r.add_post("/abort_request", lambda q: abort_request(state, q))
    r.add_post("/pause_generation", lambda q: pause_generation(state, q))
    r.add_post("/continue_generation", lambda q: continue_generation(state, q))
    r.add_post("/init_weights_update_group", lambda q: init_group(state, q))
    r.add_post("/destroy_weights_update_group", lambda q: destroy_group(state, q))
    r.add_post("/update_weights_from_distributed", lambda q: update_from_distributed(state, q))
    r.add_post("/update_weights_from_disk", lambda q: update_from_disk(state, q))
    r.add_post("/update_weight_version", lambda q: update_weight_version(state, q))
    return app


async def generate(state: ServerState, request: web.Request) -> web.Response:
    body = await _json(request)
    parsed = parse_generate(body, state.runner.config.vocab_size, state.runner.max_context, state.tokenizer,
                            state.eos_ids, has_routers=state.runner.num_moe_layers > 0)
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def deliver(req: Request) -> None:   # scheduler thread -> event loop
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(req))

    req = Request(rid=parsed.rid, input_ids=parsed.input_ids, params=parsed.params, deliver=deliver,
                  return_logprob=parsed.return_logprob, return_routes=parsed.return_routes,
                  routes_start=parsed.routes_start)
    state.scheduler.submit(req)
    finished = await done
    if state.scheduler.error and finished.finish.get("message") == state.scheduler.error:
        return error(500, f"generation failed: {state.scheduler.error}")
    return web.json_response(build_response(finished, state.tokenizer, state.scheduler.version))


async def health(state: ServerState, request: web.Request) -> web.Response:
    if not state.scheduler.alive:
        return web.Response(status=503, text=f"unhealthy: {state.scheduler.error or 'scheduler stopped'}")
    return web.Response(status=200)


async def model_info(state: ServerState, request: web.Request) -> web.Response:
    cfg = state.runner.config
    return web.json_response({
        "model_path": state.runner.model_dir, "tokenizer_path": state.runner.model_dir,
        "is_generation": True, "weight_version": str(state.scheduler.version),
        "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None),
        # extension fields (not in SGLang): what a client needs to decode routes and size requests
        "num_moe_layers": state.runner.num_moe_layers, "moe_topk": state.runner.top_k,
        "num_experts": getattr(cfg, "num_experts", None), "max_context": state.runner.max_context,
        "max_batch": state.runner.max_batch, "dtype": str(state.runner.dtype).replace("torch.", ""),
        "scheduler": state.scheduler.stats(),
    })


async def flush_cache(state: ServerState, request: web.Request) -> web.Response:
    # no prefix cache to flush: KV rows belong to live requests only
    return web.Response(status=200, text="Cache flushed.\n")


async def abort_request(state: ServerState, request: web.Request) -> web.Response:
    body = await _json(request)
    rid = parse_optional(body, "rid", str, "")
    abort_all = parse_optional(body, "abort_all", bool, False)
    await _on_scheduler(state, lambda: state.scheduler.abort(None if abort_all else rid))
    return web.Response(status=200)


async def pause_generation(state: ServerState, request: web.Request) -> web.Response:
    mode = parse_optional(await _json(request), "mode", str, "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"field 'mode' must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    await _on_scheduler(state, lambda: state.scheduler.pause(mode))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(state: ServerState, request: web.Request) -> web.Response:
    await _json(request)
    await _on_scheduler(state, state.scheduler.resume)
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


def _result(success: bool, message: str, **extra) -> web.Response:
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


def _required(body: dict, name: str, kind):
    if name not in body:
        raise BadRequest(f"field {name!r} is required")
    return parse_optional(body, name, kind)


async def init_group(state: ServerState, request: web.Request) -> web.Response:
    body = await _json(request)
    address, port = _required(body, "master_address", str), _required(body, "master_port", int)
    rank, world = _required(body, "rank_offset", int), _required(body, "world_size", int)
    name = parse_optional(body, "group_name", str, "weight_update_group")
    backend = parse_optional(body, "backend", str, "nccl")
    if backend == "nccl" and state.runner.device.type != "cuda":
        backend = "gloo"   # a CPU server's side of the group is gloo (on CUDA, --device cuda, it stays nccl)
    if name in state.groups:
        return _result(False, f"group {name!r} already exists; destroy it first")
    loop = asyncio.get_running_loop()
    try:
        group = await loop.run_in_executor(state.transfer, lambda: init_weight_update_group(
            address, port, rank, world, name, backend, state.weight_sync_timeout_s))
    except RuntimeError as err:
        return _result(False, str(err))
    state.groups[name] = group
    return _result(True, f"joined weight-update group {name!r} as rank {rank} of {world}")


async def destroy_group(state: ServerState, request: web.Request) -> web.Response:
    name = parse_optional(await _json(request), "group_name", str, "weight_update_group")
    group = state.groups.pop(name, None)
    if group is None:
        return _result(False, f"no weight-update group {name!r}")
    await asyncio.get_running_loop().run_in_executor(state.transfer, lambda: destroy_weight_update_group(group))
    return _result(True, f"destroyed group {name!r}")


def _version_arg(body: dict) -> Optional[int]:
    value = parse_optional(body, "weight_version", str)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequest(f"field 'weight_version' must be an integer string, got {value!r}") from None


async def update_from_distributed(state: ServerState, request: web.Request) -> web.Response:
    body = await _json(request)
    names, dtypes, shapes = (_required(body, k, list) for k in ("names", "dtypes", "shapes"))
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise BadRequest(f"names/dtypes/shapes must be non-empty and equally long, got "
                         f"{len(names)}/{len(dtypes)}/{len(shapes)}")
    torch_dtypes = [parse_dtype(d) for d in dtypes]
    if not all(isinstance(s, list) and all(isinstance(x, int) and x >= 0 for x in s) for s in shapes):
        raise BadRequest("field 'shapes' must be a list of lists of non-negative ints")
    name = parse_optional(body, "group_name", str, "weight_update_group")
    load_format = parse_optional(body, "load_format", str)
    if load_format not in (None, "flattened_bucket"):
        raise BadRequest(f"field 'load_format' must be null or 'flattened_bucket', got {load_format!r}")
    version = _version_arg(body)
    group = state.groups.get(name)
    if group is None:
        return _result(False, f"no weight-update group {name!r}; call /init_weights_update_group first")
    if parse_optional(body, "abort_all_requests", bool, False):
        await _on_scheduler(state, lambda: state.scheduler.abort(None, "aborted for a weight update"))
    loop = asyncio.get_running_loop()
    try:   # receive first, even if a name is wrong, so the collective stays in step with the sender
        tensors = await loop.run_in_executor(state.transfer, lambda: receive_tensors(
            names, torch_dtypes, shapes, group, load_format == "flattened_bucket", state.runner.device))
    except RuntimeError as err:
        return _result(False, str(err))
    return await _load(state, tensors, version)


async def _load(state: ServerState, tensors, version: Optional[int]) -> web.Response:
    def load():
        for name, tensor in tensors:   # validate all before writing any
            state.weights.check(name, tensor.dtype, list(tensor.shape))
        for name, tensor in tensors:
            state.weights.load(name, tensor)
        if version is not None:
            state.scheduler.version = version
    try:
        await _on_scheduler(state, load)
    except (UnknownWeightError, ValueError) as err:
        return _result(False, str(err).strip('"'))
    return _result(True, f"loaded {len(tensors)} tensors; weight version {state.scheduler.version}")


async def update_from_disk(state: ServerState, request: web.Request) -> web.Response:
    body = await _json(request)
    path = _required(body, "model_path", str)
    version = _version_arg(body)
    if not Path(path).is_dir():
        return _result(False, f"model_path {path!r} is not a directory", num_paused_requests=0)
    if parse_optional(body, "abort_all_requests", bool, False):
        await _on_scheduler(state, lambda: state.scheduler.abort(None, "aborted for a weight update"))

    def load():
        count = state.weights.load_from_disk(path)
        if version is not None:
            state.scheduler.version = version
        return count
    try:
        count = await _on_scheduler(state, load)
    except (UnknownWeightError, ValueError, FileNotFoundError) as err:
        return _result(False, str(err).strip('"'), num_paused_requests=0)
    return _result(True, f"loaded {count} tensors from {path}", num_paused_requests=0)


async def update_weight_version(state: ServerState, request: web.Request) -> web.Response:
    body = await _json(request)
    new = _required(body, "new_version", str)
    try:
        version = int(new)
    except ValueError:
        raise BadRequest(f"field 'new_version' must be an integer string, got {new!r}") from None
    if parse_optional(body, "abort_all_requests", bool, True):
        await _on_scheduler(state, lambda: state.scheduler.abort(None, "aborted for a weight version update"))

    def stamp():
        state.scheduler.version = version
    await _on_scheduler(state, stamp)
    return _result(True, f"Weight version updated to {new}", new_version=new)


async def get_weights_by_name(state: ServerState, request: web.Request) -> web.Response:
    body = await _json(request)
    if request.method == "GET" and not body:
        body = dict(request.query)
        if "truncate_size" in body:
            body["truncate_size"] = int(body["truncate_size"])
    name = _required(body, "name", str)
    truncate = parse_optional(body, "truncate_size", int, 100)
    try:
        tensor = await _on_scheduler(state, lambda: state.weights.resolve(name).clone())
    except UnknownWeightError as err:
        return error(400, str(err).strip('"'))
    values = tensor.float().tolist()
    if isinstance(values, list):
        values = values[:truncate]   # SGLang truncates the first dimension
    return web.json_response(values)
