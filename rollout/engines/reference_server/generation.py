"""POST|PUT /generate, and the path every generation takes to the scheduler (health checks and the
startup warmup included), as in SGLang's tokenizer manager (managers/tokenizer_manager.py:938-951):
wait while the server is paused, then hold the model-update read lock until the reply.

A request whose client went away (disconnect, or a client-side timeout that closes the connection)
is aborted in the scheduler, so it stops generating and frees its KV slot: SGLang's /generate does
the same when ``raw_request.is_disconnected()``. aiohttp does not cancel handlers on disconnect
(handler_cancellation is off, so weight routes always run to the end), so the wait polls the
connection every DISCONNECT_POLL_S. A cancelled wait (a /health probe that gave up) aborts too.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Optional

from aiohttp import web

from .http_io import error, read_json
from .protocol import BadRequest, build_response, parse_generate
from .scheduler import Request

DISCONNECT_POLL_S = 0.1


async def run_request(state, req: Request, gone: Optional[Callable[[], bool]] = None) -> Request:
    """Submit `req` once the server is not paused; return it finished, or None if `gone()` turned
    true first (the request is then aborted in the scheduler). Cancelling aborts it as well."""
    await state.gate.wait_unpaused()
    async with state.gate.lock.reader():
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def deliver(finished: Request) -> None:   # scheduler thread -> event loop
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(finished))

        req.deliver = deliver
        if gone is not None and gone():   # left while the server was paused: never reaches the scheduler
            return None
        state.scheduler.submit(req)
        try:
            while not await _finished_within(done, DISCONNECT_POLL_S):
                if gone is not None and gone():
                    state.scheduler.call(lambda: state.scheduler.cancel(req, "client disconnected"))
                    return None
            return done.result()
        except asyncio.CancelledError:
            state.scheduler.call(lambda: state.scheduler.cancel(req, "request cancelled"))
            raise


async def _finished_within(done: asyncio.Future, timeout_s: float) -> bool:
    finished, _ = await asyncio.wait([done], timeout=timeout_s)
    return bool(finished)


def _disconnected(request: web.Request) -> Callable[[], bool]:
    return lambda: request.transport is None or request.transport.is_closing()


async def generate(state, request: web.Request) -> web.Response:
    body = await read_json(request)
    parsed = parse_generate(body, state.runner.config.vocab_size, state.runner.max_context, state.tokenizer,
                            state.eos_ids, has_routers=state.runner.num_moe_layers > 0)
    if parsed.rid in state.in_flight:   # SGLang tokenizer_manager.py:3836 refuses it the same way
        raise BadRequest(f"Duplicate request ID detected: {parsed.rid}")
    req = Request(rid=parsed.rid, input_ids=parsed.input_ids, params=parsed.params, deliver=lambda _: None,
                  return_logprob=parsed.return_logprob, return_routes=parsed.return_routes,
                  routes_start=parsed.routes_start, return_indexer_topk=parsed.return_indexer_topk)
    state.in_flight.add(parsed.rid)
    try:
        finished = await run_request(state, req, gone=_disconnected(request))
    finally:
        state.in_flight.discard(parsed.rid)
    if finished is None:   # nobody is listening; aiohttp drops whatever we answer
        return web.Response(status=499)
    if state.scheduler.error and finished.finish.get("message") == state.scheduler.error:
        return error(500, f"generation failed: {state.scheduler.error}")
    return web.json_response(build_response(finished, state.tokenizer, state.scheduler.version))
