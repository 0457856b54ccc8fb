"""ScriptedEngine: a simulated rollout server in this process, for tests and benchmarks only.

It runs no model: tokens come from a script or a responder, latency from a timing model. It plays both
roles of a rollout server (`Generator`, `WeightReceiver`) so the driver and the update window can be
tested and benchmarked without a server (tests/unit, bench/pipeline.py); training never uses it.

Timing model: each output token takes ``token_time_s`` (slept once per ``tokens_per_tick`` tokens) (continuous batching without a capacity
limit unless ``max_running`` is set), so a request's latency is proportional to its length. The
length of a response is drawn from ``length_fn(rng)`` (long-tailed by default: lognormal).

Pause semantics follow SGLang's /pause_generation modes:
- "abort": running requests end at once with finish_reason "abort" and the tokens so far;
- "retract" / "in_place": running requests stop producing tokens and continue after resume()
  (retract would recompute the KV cache on a real server; here there is no cache to lose).
New requests wait while paused. Each token is sampled under the engine's current ``version``,
reported per token when ``report_versions`` is True.

``script`` replaces the random response with exact tokens chosen from the input (agent tests);
generation stops after a token in the request's stop_token_ids.

Failure injection: ``kill()`` makes every running and future call raise EngineError until
``revive()``; ``fail_prob`` fails a request at a random token.

Weight-update protocol as SGLang 0.5.23: update_weights_from_distributed is refused outside a
begin/end_weight_update session; /flush_cache is refused while requests paused in place are running.
``calls`` records every control call in order; ``namespaces`` the prefix-cache namespace
(``cache_namespace``) each request id was sent under.
"""
from __future__ import annotations

import asyncio
import math
import random
from typing import Callable, Optional

import torch

from rollout.engines.engine import EngineError, GenerateRequest, GenerateResult, Generator
from rollout.weights.receiver import WeightReceiver


def lognormal_lengths(median: float = 16.0, sigma: float = 1.0) -> Callable[[random.Random], int]:
    mu = math.log(median)
    return lambda rng: max(1, int(rng.lognormvariate(mu, sigma)))


def digit_responder(input_ids: list[int], step: int) -> int:
    return 7 + (step % 10)          # '0'..'9' in the char-level tokenizer


class ScriptedEngine(Generator, WeightReceiver):
    def __init__(self, name: str = "fake0", *, token_time_s: float = 0.0, eos_id: int = 2,
                 length_fn: Optional[Callable[[random.Random], int]] = None,
                 responder: Callable[[list[int], int], int] = digit_responder, version: int = 0,
                 report_versions: bool = True, fail_prob: float = 0.0, seed: int = 0,
                 routed_layers: int = 0, max_running: int = 0, abort_returns_output: bool = True,
                 script: Optional[Callable[[list[int]], list[int]]] = None, tokens_per_tick: int = 1):
        self.name, self.token_time_s, self.eos_id = name, token_time_s, eos_id
        self.length_fn = length_fn or lognormal_lengths()
        self.responder, self.version, self.report_versions = responder, version, report_versions
        self.fail_prob, self.rng = fail_prob, random.Random(seed)
        self.routed_layers, self.abort_returns_output = routed_layers, abort_returns_output
        self.script = script                 # input_ids -> the exact output tokens (agent tests)
        self.tokens_per_tick = tokens_per_tick   # sleep once per this many tokens (less loop overhead)
        self.dead = False
        self.paused_mode: Optional[str] = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._aborted: set[str] = set()
        self._running: set[str] = set()
        self._slots = asyncio.Semaphore(max_running) if max_running else None
        self.rids: list[str] = []            # every request id received, in order
        self.namespaces: dict[str, Optional[str]] = {}   # rid -> cache_namespace it was sent under
        self.calls: list[str] = []           # control calls in order (pause:mode, flush_cache, ...)
        self.session_open = False
        self.tokens_generated = 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._check_alive()
        self.rids.append(request.rid)
        self.namespaces[request.rid] = self.cache_namespace
        await self._resumed.wait()
        if self._slots is None:
            return await self._generate(request)
        async with self._slots:
            return await self._generate(request)

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        self._running.add(request.rid)
        try:
            return await self._token_loop(request)
        finally:
            self._running.discard(request.rid)
            self._aborted.discard(request.rid)

    async def _token_loop(self, request: GenerateRequest) -> GenerateResult:
        planned = self.script(request.input_ids) if self.script else None
        target = len(planned) if planned is not None else self.length_fn(self.rng)
        fail_at = self.rng.randrange(max(target, 1)) if self.rng.random() < self.fail_prob else -1
        out, versions = [], []
        finish = "length"
        for step in range(request.max_new_tokens):
            if step % self.tokens_per_tick == 0:
                await asyncio.sleep(self.token_time_s * self.tokens_per_tick)
            while not self._resumed.is_set() and request.rid not in self._aborted:
                await asyncio.sleep(0.002)
            self._check_alive()
            if request.rid in self._aborted:
                finish = "abort"
                if not self.abort_returns_output:
                    out, versions = [], []
                break
            if step == fail_at:
                raise EngineError(f"engine {self.name}: injected failure in {request.rid}")
            if planned is not None:
                token = planned[step]
                last = step + 1 >= target or token in request.stop_token_ids
            else:
                last = step + 1 >= target
                token = self.eos_id if last else self.responder(request.input_ids + out, step)
            out.append(token)
            versions.append(self.version)
            self.tokens_generated += 1
            if last:
                finish = "stop"
                break
        return self._result(request, out, versions, finish)

    def _result(self, request, out, versions, finish) -> GenerateResult:
        routes = None
        if self.routed_layers and request.return_routed_experts:
            rows = len(request.input_ids) + len(out) - 1
            routes = torch.zeros(rows, self.routed_layers, 2, dtype=torch.int32)
        return GenerateResult(rid=request.rid, output_ids=out, output_logprobs=[-1.0] * len(out),
                              finish_reason=finish, weight_version=self.version,
                              output_weight_versions=versions if self.report_versions else None,
                              routed_experts=routes, prompt_tokens=len(request.input_ids), engine=self.name)

    def _check_alive(self):
        if self.dead:
            raise EngineError(f"engine {self.name}: connection refused (killed)")

    def kill(self):
        self.dead = True

    def revive(self):
        self.dead = False

    def _control(self, what: str) -> None:
        self._check_alive()
        self.calls.append(what)

    async def abort(self, rid: Optional[str] = None) -> None:
        self._control("abort")
        self._aborted.update(self._running if rid is None else {rid})

    async def pause(self, mode: str = "in_place") -> None:
        self._control(f"pause:{mode}")
        self.paused_mode = mode
        self._resumed.clear()
        if mode == "abort":
            self._aborted.update(self._running)

    async def resume(self) -> None:
        self._control("continue")
        self.paused_mode = None
        self._resumed.set()

    async def flush_cache(self) -> None:
        self._control("flush_cache")
        if self.paused_mode == "in_place" and self._running - self._aborted:
            raise EngineError(f"engine {self.name}: /flush_cache answered HTTP 400: requests are still running")

    async def health(self) -> bool:
        return not self.dead

    async def weight_version(self) -> int:
        self._check_alive()
        return self.version

    async def init_weights_update_group(self, *args, **kwargs) -> None:
        self._control("init_weights_update_group")

    async def destroy_weights_update_group(self, group_name: str) -> None:
        self._control("destroy_weights_update_group")

    async def begin_weight_update(self) -> None:
        self._control("begin_weight_update")
        if self.session_open:
            raise EngineError(f"engine {self.name}: /begin_weight_update failed: a session is already open")
        self.session_open = True

    async def end_weight_update(self) -> None:
        self._control("end_weight_update")
        if not self.session_open:
            raise EngineError(f"engine {self.name}: /end_weight_update failed: no session is open")
        self.session_open = False

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name, weight_version,
                                              flattened_bucket=True, flush_cache=True) -> None:
        self._control("update_weights_from_distributed")
        if not self.session_open:
            raise EngineError(f"engine {self.name}: /update_weights_from_distributed failed: must run between "
                              "begin_weight_update() and end_weight_update()")
        self.version = weight_version

    async def update_weights_from_disk(self, model_path: str, weight_version: int, flush_cache: bool = True) -> None:
        self._control("update_weights_from_disk")
        self.version = weight_version

    async def get_weights_by_name(self, name: str) -> torch.Tensor:
        raise EngineError(f"engine {self.name}: the scripted engine holds no weights")
