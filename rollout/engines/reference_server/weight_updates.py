"""Weight-update routes as SGLang 0.5.23 answers them (paths under sglang/srt/).

Sessions (managers/scheduler_components/weight_updater.py:79-94 selector, :187-197 and :200-204
the session check, :381-405 begin/end; entrypoints/http_server.py:1458-1486):
POST /begin_weight_update {"selector": "all"|"target"|"draft"} opens one session (400 if one is
open); POST /end_weight_update closes it (400 if none is). /update_weights_from_distributed outside
a session is refused at once, BEFORE anything is received: the trainer's broadcast for that call
finds no receiver here (it waits on its own side until its group timeout, as with SGLang); this
server never blocks on a collective it refused. /update_weights_from_disk needs no session.

Every update runs behind the gate (gate.py): at once while paused, else under the write lock, so
an unpaused update waits for in-flight requests. After a successful load, ``flush_cache`` (default
true in both request structs, io_struct.py:1970-2016) asks for the scheduler's flush, which is
refused unless it is idle (Scheduler.flush_cache); then the call fails with SGLang's message although
the weights and version WERE updated (weight_updater.py:117-129, 155-160, 236-242).

Engine TP: the server joins the group as ``rank_offset + i`` for each of its ``--tp`` ranks and
every rank receives every bucket (tp_ranks.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Optional

from aiohttp import web

from .http_io import error, on_scheduler, read_json, required, result
from . import shard_writes
from .protocol import BadRequest, parse_optional
from .rank_calls import in_thread, on_every_rank
from .tp_ranks import digest
from .weight_group import destroy_weight_update_group, init_weight_update_group, receive_buffer, receive_tensors
from .weights import UnknownWeightError, parse_dtype, read_safetensors

SELECTORS = ("target", "draft", "all")
NO_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_TO_END = "no weight-update session is open; call begin_weight_update() first"
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")


def add_routes(router: web.UrlDispatcher, state) -> None:
    router.add_post("/begin_weight_update", lambda q: begin_weight_update(state, q))
    router.add_post("/end_weight_update", lambda q: end_weight_update(state, q))
    router.add_post("/init_weights_update_group", lambda q: init_group(state, q))
    router.add_post("/destroy_weights_update_group", lambda q: destroy_group(state, q))
    router.add_post("/update_weights_from_distributed", lambda q: update_from_distributed(state, q))
    router.add_post("/update_weights_from_disk", lambda q: update_from_disk(state, q))
    router.add_post("/update_weight_version", lambda q: update_weight_version(state, q))
    for method in ("GET", "POST"):
        router.add_route(method, "/get_weights_by_name", lambda q: get_weights_by_name(state, q))
    shard_writes.add_routes(router, state)   # opt-in (--shard-writes), not SGLang's: shard_writes.py


def _selector(body: dict) -> str:
    selector = parse_optional(body, "selector", str, "all")
    if selector not in SELECTORS:
        raise BadRequest(f"field 'selector' must be one of {', '.join(SELECTORS)}, got {selector!r}")
    return selector


async def begin_weight_update(state, request: web.Request) -> web.Response:
    selector = _selector(await read_json(request))

    async def begin():
        if state.session is not None:
            return result(False, SESSION_OPEN)
        state.session = selector
        return result(True, "Success")
    return await state.gate.update(begin)


async def end_weight_update(state, request: web.Request) -> web.Response:
    await read_json(request)

    async def end():
        if state.session is None:
            return result(False, NO_SESSION_TO_END)
        state.session = None
        return result(True, "Success")
    return await state.gate.update(end)


async def init_group(state, request: web.Request) -> web.Response:
    body = await read_json(request)
    address, port = required(body, "master_address", str), required(body, "master_port", int)
    rank, world = required(body, "rank_offset", int), required(body, "world_size", int)
    name = parse_optional(body, "group_name", str, "weight_update_group")
    backend = parse_optional(body, "backend", str, "nccl")
    tp = state.tp_ranks.tp
    if rank < 1:   # the broadcast's source is rank 0 (weight_group.py): this server would send to itself
        raise BadRequest(f"field 'rank_offset' is {rank}: rank 0 is the trainer's sender, so the server's ranks "
                         "start at 1 (SGLang: rank_offset = 1 + the TP ranks of the engines before it)")
    if rank + tp > world:
        raise BadRequest(f"rank_offset {rank} with --tp {tp} needs ranks {rank}..{rank + tp - 1} < world_size "
                         f"{world}; the trainer's world_size must count every TP rank of every engine")
    if backend == "nccl" and state.runner.device.type != "cuda":
        backend = "gloo"   # a CPU server's side of the group is gloo (on CUDA, --device cuda, it stays nccl)
    if name in state.groups:
        return result(False, f"Failed to initialize custom process group: group {name!r} already exists.")

    def join():   # every TP rank joins at once: the rendezvous waits for all world_size members
        group, _ = on_every_rank(state, "join", lambda i: (address, port, rank + i, world, name, "gloo"),
                                  lambda: init_weight_update_group(address, port, rank, world, name, backend,
                                                                   state.weight_sync_timeout_s),
                                  undo=destroy_weight_update_group)
        return group
    try:
        state.groups[name] = await in_thread(state, join)
    except RuntimeError as err:
        return result(False, f"Failed to initialize custom process group: {err}.")
    return result(True, "Succeeded to initialize custom process group.")


async def destroy_group(state, request: web.Request) -> web.Response:
    name = parse_optional(await read_json(request), "group_name", str, "weight_update_group")
    group = state.groups.pop(name, None)
    if group is None:
        return result(False, "The group to be destroyed does not exist.")

    await in_thread(state, lambda: on_every_rank(state, "destroy", lambda i: name,
                                                   lambda: destroy_weight_update_group(group)))
    return result(True, "Succeeded to destroy custom process group.")


def _version_arg(body: dict) -> Optional[int]:
    value = parse_optional(body, "weight_version", str)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequest(f"field 'weight_version' must be an integer string, got {value!r}") from None


def _tensor_meta(body: dict) -> tuple[list, list, list]:
    names, dtypes, shapes = (required(body, k, list) for k in ("names", "dtypes", "shapes"))
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise BadRequest(f"names/dtypes/shapes must be non-empty and equally long, got "
                         f"{len(names)}/{len(dtypes)}/{len(shapes)}")
    try:
        [parse_dtype(d) for d in dtypes]
    except ValueError as err:
        raise BadRequest(f"field 'dtypes': {err}") from None
    if not all(isinstance(s, list) and all(isinstance(x, int) and 0 <= x < 2**63 for x in s) for s in shapes):
        raise BadRequest("field 'shapes' must be a list of lists of ints in [0, 2**63)")   # torch sizes are int64
    return names, dtypes, shapes


async def _abort_if_asked(state, body: dict) -> None:
    if parse_optional(body, "abort_all_requests", bool, False):
        await on_scheduler(state, lambda: state.scheduler.abort(None, "aborted for a weight update"))


async def update_from_distributed(state, request: web.Request) -> web.Response:
    body = await read_json(request)
    names, dtypes, shapes = _tensor_meta(body)
    name = parse_optional(body, "group_name", str, "weight_update_group")
    load_format = parse_optional(body, "load_format", str)
    if load_format not in (None, "flattened_bucket"):
        raise BadRequest(f"field 'load_format' must be null or 'flattened_bucket', got {load_format!r}")
    version, selector = _version_arg(body), _selector(body)
    flush = parse_optional(body, "flush_cache", bool, True)
    await _abort_if_asked(state, body)

    async def update():
        if state.session is None:   # weight_updater.py:192-197: refused before any receive
            return result(False, NO_SESSION)
        try:
            tensors = await in_thread(state, lambda: _receive_all(state, names, dtypes, shapes, name, load_format))
        except (RuntimeError, ValueError) as err:
            return result(False, f"Failed to receive weights: {err}")
        if selector == "draft":     # no draft model here: nothing to load it into (weight_updater.py:218)
            tensors = []
        return await _load(state, tensors, version, flush, "Succeeded to update parameter online.")
    return await state.gate.update(update)


def _receive_all(state, names, dtypes, shapes, group_name, load_format):
    """Receive on every TP rank at once; only rank 0's copy is loaded, the others must match it."""
    group = state.groups.get(group_name)
    if group is None:   # SGLang asserts this inside the receive (model_runner weight_updater.py:270)
        raise RuntimeError(f"Group {group_name} not in {list(state.groups)}. "
                           "Please call `init_weights_update_group` first.")
    if group.rank() == 0:   # broadcast(src=0) returns at once on its source: torch.empty is all it holds
        raise RuntimeError("this server is rank 0 of the group, the broadcast's source, so it would receive "
                           "nothing; form the group with rank_offset >= 1. The old weights stay")
    flattened = load_format == "flattened_bucket"
    tensors, others = on_every_rank(
        state, "receive", lambda i: (names, dtypes, shapes, group_name, flattened),
        lambda: receive_tensors(names, [parse_dtype(d) for d in dtypes], shapes, group, flattened,
                                state.runner.device, receive_buffer(state)))
    mine = digest(tensors)
    for tp_rank, theirs in enumerate(others, start=1):
        if theirs != mine:
            raise RuntimeError(f"TP rank {tp_rank} received different bytes than TP rank 0")
    return tensors


def _install(state, tensors, version: Optional[int], flush: bool) -> bool:
    """On the scheduler: validate every tensor before writing any, write them, set the version, and ask for
    the flush (SGLang's order); False when the flush was refused."""
    staged = state.weights.prepare(tensors)   # --quantization fp8: FP8 pairs -> model dtype, or refused
    for name, tensor in staged:
        state.weights.check(name, tensor.dtype, list(tensor.shape))
    for name, tensor in staged:
        state.weights.load(name, tensor)
    if version is not None:
        state.scheduler.version = version
    return not flush or state.scheduler.flush_cache()


async def _load(state, tensors, version: Optional[int], flush: bool, success: str) -> web.Response:
    """Install the tensors (`_install`) and answer as SGLang's update calls do."""
    try:
        flushed = await on_scheduler(state, lambda: _install(state, tensors, version, flush))
    except (UnknownWeightError, ValueError) as err:
        return result(False, f"Failed to update parameter online: {str(err).strip(chr(34))}")
    if not flushed:
        return result(False, NOT_FLUSHED)
    return result(True, success + (f" Weight version updated to {version}." if version is not None else ""))


async def update_from_disk(state, request: web.Request) -> web.Response:
    """As SGLang, the update takes the write lock on arrival (tokenizer_manager.py:771: in-flight
    generations finish, new ones wait behind it), then reads the files: here off the event loop and
    the scheduler, under a timeout, so a hung file (a FIFO, a dead network mount) fails this call after
    --weight-sync-timeout-s and releases the lock, while /health answers throughout and waiting
    generations go on afterwards (in SGLang everything waits for as long as the read hangs). Only a
    complete read is installed, so a failed one leaves the old weights."""
    body = await read_json(request)
    path = required(body, "model_path", str)
    version, flush = _version_arg(body), parse_optional(body, "flush_cache", bool, True)
    load_format = parse_optional(body, "load_format", str) or state.load_format
    busy = state.disk_read
    if busy is not None:
        return result(False, f"Failed to update weights: the read of {busy!r} has not finished (a hung file "
                             "or mount?); fix it, or restart the server", num_paused_requests=0)
    state.disk_read = path
    started = []

    def read_ended():
        state.disk_read = None

    async def update():
        started.append(True)
        try:
            tensors = await _off_loop(lambda: read_safetensors(path), state.weight_sync_timeout_s, read_ended)
        except ValueError as err:
            return result(False, f"Failed to get weights iterator: {err}. The old weights stay.",
                          num_paused_requests=0)
        except asyncio.TimeoutError:
            return result(False, f"Failed to update weights: reading {path!r} did not finish within "
                                 f"{state.weight_sync_timeout_s:g} s (--weight-sync-timeout-s; a hung file or "
                                 "mount?). The old weights stay.", num_paused_requests=0)
        await _abort_if_asked(state, body)
        try:
            flushed = await on_scheduler(state, lambda: _install(state, tensors, version, flush))
        except (UnknownWeightError, ValueError) as err:
            return result(False, f"Failed to update weights: {str(err).strip(chr(34))}", num_paused_requests=0)
        if not flushed:
            return result(False, NOT_FLUSHED, num_paused_requests=0)
        state.model_path, state.load_format = path, load_format   # tokenizer_manager.py:2380-2383
        done = "Succeeded to update model weights." + (f" Weight version updated to {version}." if version
                                                        is not None else "")
        return result(True, done, num_paused_requests=0)
    try:
        return await state.gate.update(update, hold_pause_lock=False)
    finally:
        if not started:   # the gate never ran the read (cancelled while waiting): nothing is reading
            read_ended()


async def _off_loop(fn, timeout_s: float, on_end):
    """`fn()` in a daemon thread, its result within `timeout_s` (else asyncio.TimeoutError). A read
    blocked in the kernel cannot be cancelled: the thread runs on, `on_end()` runs on the loop when it
    ends, and being a daemon it never holds up the server's exit."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    done.add_done_callback(lambda f: f.cancelled() or f.exception())   # nobody awaits it after a timeout

    def settle(value, err):
        on_end()
        if not done.done():
            done.set_exception(err) if err is not None else done.set_result(value)

    def run():
        try:
            value, err = fn(), None
        except BaseException as exc:   # handed to the awaiting route, which names it
            value, err = None, exc
        with contextlib.suppress(RuntimeError):   # the loop is closed: the server is gone
            loop.call_soon_threadsafe(settle, value, err)
    threading.Thread(target=run, name="sao-disk-read", daemon=True).start()
    return await asyncio.wait_for(asyncio.shield(done), timeout_s)


async def update_weight_version(state, request: web.Request) -> web.Response:
    body = await read_json(request)
    new = required(body, "new_version", str)
    try:
        version = int(new)
    except ValueError:
        raise BadRequest(f"field 'new_version' must be an integer string, got {new!r}") from None
    if parse_optional(body, "abort_all_requests", bool, True):
        await on_scheduler(state, lambda: state.scheduler.abort(None, "aborted for a weight version update"))

    def stamp():
        state.scheduler.version = version
    await on_scheduler(state, stamp)
    return result(True, f"Weight version updated to {new}", new_version=new)


async def get_weights_by_name(state, request: web.Request) -> web.Response:
    body = await read_json(request)
    if request.method == "GET" and not body:
        body = dict(request.query)
        if "truncate_size" in body:
            try:
                body["truncate_size"] = int(body["truncate_size"])
            except ValueError:
                raise BadRequest(f"query parameter 'truncate_size' must be an integer, got "
                                 f"{body['truncate_size'][:40]!r}") from None
    name = required(body, "name", str)
    truncate = parse_optional(body, "truncate_size", int, 100)
    try:
        tensor = await on_scheduler(state, lambda: state.weights.resolve(name).clone())
    except UnknownWeightError as err:
        return error(400, str(err).strip('"'))
    values = tensor.float().tolist()
    if isinstance(values, list):
        values = values[:truncate]   # SGLang truncates the first dimension
    return web.json_response(values)
