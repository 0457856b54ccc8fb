"""GET /health and /health_generate, and the startup warmup, as SGLang 0.5.23 answers them
(entrypoints/http_server.py:721-799 health_generate; :2360-2502 the warmup that ends "Starting").

A probe is a real generate: ``input_ids [0]``, ``max_new_tokens 1``, ``temperature 0``, rid prefixed
``HEALTH_CHECK``. It takes the path of every request (generation.run_request), so while the server
is paused it waits in front of the scheduler like any new request, no output arrives, and after
``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (default 20) the probe answers 503 and marks the server
UnHealthy (which a later successful probe undoes). The probe passes as soon as the scheduler
produces ANY output after it was asked (SGLang compares ``last_receive_tstamp`` with the probe's
start), so on a busy server the probe itself is skipped and the next step answers for it
(scheduler.py). 503 also while Starting (before the warmup generate) and while shutting down.
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` makes /health (not /health_generate) answer 200
without generating. Differences kept on purpose: SGLang polls once a second, we poll every 20 ms;
a dead scheduler answers 503 at once instead of after the timeout.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid

from aiohttp import web

from .generation import run_request
from .sampling import SamplingParams
from .scheduler import HEALTH_RID_PREFIX, Request
from .state import STARTING, UNHEALTHY, UP

log = logging.getLogger(__name__)
POLL_S = 0.02
_TRUE, _FALSE = ("true", "1", "yes", "y"), ("false", "0", "no", "n")   # SGLang environ.py:143 EnvBool


def generation_enabled() -> bool:
    """SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION (SGLang environ.py:344, default True)."""
    raw = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower()
    if raw not in _TRUE + _FALSE:
        raise ValueError(f"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION={raw!r} is not a boolean; use true or false")
    return raw in _TRUE


def _probe(rid: str, input_ids: list[int], max_new_tokens: int) -> Request:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    return Request(rid=rid, input_ids=input_ids, params=params, deliver=lambda _: None,
                   return_logprob=False, internal=True)


async def health(state, request: web.Request) -> web.Response:
    if state.exiting or state.status == STARTING:
        return web.Response(status=503)
    if not generation_enabled() and request.path == "/health":
        return web.Response(status=200)
    if not state.scheduler.alive:
        return web.Response(status=503, text=f"unhealthy: {state.scheduler.error or 'scheduler stopped'}")
    tic = time.monotonic()
    task = asyncio.create_task(run_request(state, _probe(f"{HEALTH_RID_PREFIX}_{uuid.uuid4().hex}", [0], 1)))
    try:
        while time.monotonic() < tic + state.health_timeout_s:
            await asyncio.sleep(POLL_S)
            if state.scheduler.last_output > tic:
                state.status = UP
                return web.Response(status=200)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    log.error("health check failed: no output from the scheduler for %d s (paused: %s)",
              state.health_timeout_s, state.gate.paused)
    state.status = UNHEALTHY
    return web.Response(status=503)


async def warmup(state) -> None:
    """One greedy generate of 8 tokens through the normal path, then the server is Up
    (SGLang _execute_server_warmup; it sends input_ids [10, 11, 12] when it has no tokenizer)."""
    vocab = state.runner.config.vocab_size
    input_ids = [10, 11, 12] if vocab > 12 else [0]
    max_new = max(1, min(8, state.runner.max_context - len(input_ids)))
    finished = await run_request(state, _probe("warmup", input_ids, max_new))
    if finished.finish is None or finished.finish.get("type") == "abort":
        raise RuntimeError(f"it finished with {finished.finish}")
    state.status = UP
