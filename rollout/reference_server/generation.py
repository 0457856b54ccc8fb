"""POST|PUT /generate, and the path every generation takes to the scheduler (health checks and the
startup warmup included), as in SGLang's tokenizer manager (managers/tokenizer_manager.py:938-951):
wait while the server is paused, then hold the model-update read lock until the reply.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from .http_io import error, read_json
from .protocol import build_response, parse_generate
from .scheduler import Request


async def run_request(state, req: Request) -> Request:
    """Submit `req` once the server is not paused; return it finished (cancellable while waiting)."""
    await state.gate.wait_unpaused()
    async with state.gate.lock.reader():
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def deliver(finished: Request) -> None:   # scheduler thread -> event loop
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(finished))

        req.deliver = deliver
        state.scheduler.submit(req)
        return await done


async def generate(state, request: web.Request) -> web.Response:
    body = await read_json(request)
    parsed = parse_generate(body, state.runner.config.vocab_size, state.runner.max_context, state.tokenizer,
                            state.eos_ids, has_routers=state.runner.num_moe_layers > 0)
    req = Request(rid=parsed.rid, input_ids=parsed.input_ids, params=parsed.params, deliver=lambda _: None,
                  return_logprob=parsed.return_logprob, return_routes=parsed.return_routes,
                  routes_start=parsed.routes_start)
    finished = await run_request(state, req)
    if state.scheduler.error and finished.finish.get("message") == state.scheduler.error:
        return error(500, f"generation failed: {state.scheduler.error}")
    return web.json_response(build_response(finished, state.tokenizer, state.scheduler.version))
