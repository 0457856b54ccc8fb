"""The batching scheduler: one thread owns the model and runs every active request each step.

Step-level continuous batching: between steps the thread runs queued control commands (abort,
pause, weight loads, reads), admits waiting requests into free KV slots, then runs ONE forward over
all active rows (new prompts and single decode tokens together), samples one token per row and
finishes rows that hit a stop token, their budget or the context limit. Each sampled token is
stamped with the weight version the forward ran with, so a request that spans an update reports
mixed versions.

Pause (SGLang's scheduler-side ``_engine_paused``, managers/scheduler.py:5817 pause_generation):
``retract`` pauses and drops running requests' KV (they go back to the queue and re-prefill prompt +
tokens so far on /continue_generation, re-recording their routes with the weights of that moment);
``in_place`` pauses and keeps the KV and the running batch. Mode ``abort`` never reaches the
scheduler in SGLang (the tokenizer side aborts everything), and new requests wait in front of the
scheduler while paused (app.py / gate.py), as in SGLang's tokenizer manager.

Health checks (rid prefix ``HEALTH_CHECK``, SGLang constants.py:12): when anything else is running
or queued, the check is dropped instead of run, because the next step's output already proves the
scheduler alive (SGLang scheduler.py:2241 "Skip health check when server is busy").
``last_output`` is the time of the last step: SGLang's /health waits for any output after it asked.

DSA indexer top-k: recorded, like routes, for requests that set ``return_indexer_topk`` when the
server runs with ``--enable-return-indexer-topk`` and the model has an indexer; otherwise the reply
has no such field, as SGLang's (docs/engines.md "DSA indexer top-k").
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .model_runner import ModelRunner
from .sampling import SamplingParams, make_generator, sample_batch, scaled_logprobs

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "retract", "in_place")
SCHEDULER_PAUSE_MODES = ("retract", "in_place")   # SGLang scheduler.py:5818 asserts these two
HEALTH_RID_PREFIX = "HEALTH_CHECK"                # SGLang constants.py:12 HEALTH_CHECK_RID_PREFIX


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    deliver: Callable[["Request"], None]      # called once, from the scheduler thread, when finished
    return_logprob: bool = True
    return_routes: bool = False
    routes_start: int = 0
    return_indexer_topk: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: Optional[torch.Tensor] = None     # int32 [prompt + max_new - 1, layers, topk], filled as fed
    indexer_topk: Optional[torch.Tensor] = None   # int32 [prompt + max_new - 1, layers, index_topk], as fed
    kv_len: int = 0
    retractions: int = 0
    finish: Optional[dict] = None
    generator: Optional[torch.Generator] = None   # set by Scheduler.submit
    internal: bool = False    # warmup / health: consumes no request seed, so seeded runs replay exactly

    @property
    def tokens(self) -> list[int]:
        return self.input_ids + self.output_ids


class Scheduler:
    def __init__(self, runner: ModelRunner, eos_token_ids: list[int], weight_version: int = 0,
                 seed: Optional[int] = None, enable_return_indexer_topk: bool = False):
        self.runner = runner
        # SGLang captures DSA selections only under --enable-return-indexer-topk, and only for a model
        # with indexer layers (state_capturer/indexer_topk.py _create_indexer_capturer_raw)
        self.capture_indexer = enable_return_indexer_topk and runner.index_topk > 0
        if enable_return_indexer_topk and not self.capture_indexer:
            log.warning("No indexer layers found, IndexerTopkCapturer disabled")
        self.seed = seed                      # base seed for requests without sampling_seed
        self._submitted = 0
        self.eos = set(eos_token_ids)
        self.version = weight_version
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []      # index == KV slot
        self.paused = False                   # SGLang's _engine_paused (in_place / retract only)
        self.last_output = 0.0                # time.monotonic() of the last finished step
        self.health_checks_skipped = 0
        self.cancelled = 0                    # requests aborted because their client went away
        self.error: Optional[str] = None      # set if a step raised; the server then exits (server.py)
        self.on_failure: Callable[[str], None] = lambda message: None   # called from the dying thread
        self._commands: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="sao-scheduler", daemon=True)

    # ---- API used by the HTTP layer (any thread) ----
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def submit(self, request: Request) -> None:
        with self._cond:
            if self.error:
                raise RuntimeError(f"scheduler failed earlier: {self.error}")
            seed = request.params.sampling_seed
            if seed is None and self.seed is not None and not request.internal:   # reproducible runs
                seed = (self.seed * 1_000_003 + self._submitted) % 2**64   # torch's seed range
            self._submitted += 0 if request.internal else 1
            request.generator = make_generator(seed)
            self.waiting.append(request)
            self._cond.notify()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the scheduler thread between steps; the future carries its result or error."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self.error:
                future.set_exception(RuntimeError(f"scheduler failed earlier: {self.error}"))
                return future
            self._commands.append((fn, future))
            self._cond.notify()
        return future

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ---- commands (run on the scheduler thread via `call`) ----
    def abort(self, rid: Optional[str] = None, message: str = "aborted by request") -> int:
        """Abort one rid (None = all); returns how many requests were aborted."""
        with self._cond:   # `submit` appends to `waiting` from the HTTP thread
            hit = [r for r in list(self.running) + list(self.waiting) if rid is None or r.rid == rid]
            for req in hit:
                req.finish = {"type": "abort", "message": message}
            self._remove_finished()
            self.waiting = collections.deque(r for r in self.waiting if r.finish is None)
        for req in hit:
            req.deliver(req)
        return len(hit)

    def cancel(self, request: Request, message: str) -> bool:
        """Abort this one request object (its client is gone) unless it already finished."""
        with self._cond:
            if request.finish is not None or not any(r is request for r in list(self.running) + list(self.waiting)):
                return False
            request.finish = {"type": "abort", "message": message}
            self.cancelled += 1
            self._remove_finished()
            self.waiting = collections.deque(r for r in self.waiting if r.finish is None)
        request.deliver(request)
        return True

    def pause(self, mode: str) -> None:
        if mode not in SCHEDULER_PAUSE_MODES:
            raise ValueError(f"scheduler pause mode {mode!r} unknown; use one of {', '.join(SCHEDULER_PAUSE_MODES)}")
        if mode == "retract":
            with self._cond:
                for slot in reversed(range(len(self.running))):
                    req = self.running[slot]
                    self._free_slot(slot)
                    req.kv_len, req.retractions = 0, req.retractions + 1
                    self.waiting.appendleft(req)
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def is_fully_idle(self, ignore_waiting: bool = False) -> bool:
        """Nothing running (and, unless ignored, nothing queued): SGLang scheduler.py:5337."""
        with self._cond:
            return not self.running and (ignore_waiting or not self.waiting)

    def flush_cache(self) -> bool:
        """SGLang scheduler.py:5518: refused (False) unless fully idle; while paused the queue is ignored,
        so a retract pause flushes and an in-place pause (requests kept in the running batch) does not.
        The reference server holds no prefix cache, so a granted flush has nothing else to drop."""
        return self.is_fully_idle(ignore_waiting=self.paused)

    # ---- the loop ----
    def _loop(self) -> None:
        try:
            with torch.no_grad():   # grad mode is per thread: this thread never needs autograd
                self._serve_forever()
        except BaseException as err:   # never swallow: record, fail every request, stop the server
            self.error = f"{type(err).__name__}: {err}"
            log.error("scheduler step failed:\n%s", traceback.format_exc())
        self._fail_all(self.error or "server shutting down")
        if self.error:
            self.on_failure(self.error)

    def _serve_forever(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._commands or
                           (not self.paused and (self.running or self.waiting))):
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    break
                commands, self._commands = list(self._commands), collections.deque()
            for fn, future in commands:
                self._run_command(fn, future)
            self._skip_busy_health_checks()
            if not self.paused:
                self._admit()
                if self.running:
                    self._step()

    @staticmethod
    def _run_command(fn, future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except Exception as err:   # the caller gets the error through the future
            future.set_exception(err)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            commands, self._commands = list(self._commands), collections.deque()
        for _, future in commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(f"scheduler stopped: {message}"))
        for req in list(self.running) + list(self.waiting):
            req.finish = {"type": "abort", "message": message}
            req.deliver(req)
        self.running, self.waiting = [], collections.deque()

    def _skip_busy_health_checks(self) -> None:
        """Drop each queued health check that arrived behind other work (in arrival order)."""
        with self._cond:
            kept: collections.deque[Request] = collections.deque()
            for req in self.waiting:
                busy = bool(self.running or kept)
                if not (busy and req.rid.startswith(HEALTH_RID_PREFIX)):
                    kept.append(req)
                else:
                    self.health_checks_skipped += 1
            self.waiting = kept

    def _admit(self) -> None:
        with self._cond:
            while self.waiting and len(self.running) < self.runner.max_batch:
                req = self.waiting.popleft()
                rows = min(len(req.input_ids) + req.params.max_new_tokens, self.runner.max_context) - 1
                if req.return_routes and req.routes is None:
                    req.routes = torch.zeros(rows, self.runner.num_layers, self.runner.top_k, dtype=torch.int32)
                if req.return_indexer_topk and self.capture_indexer and req.indexer_topk is None:
                    req.indexer_topk = torch.full((rows, self.runner.num_layers, self.runner.index_topk), -1,
                                                  dtype=torch.int32)
                self.running.append(req)

    def _step(self) -> None:
        chunks = [req.tokens[req.kv_len:] for req in self.running]
        lengths = [req.kv_len for req in self.running]
        want_routes = any(req.return_routes for req in self.running)
        want_indexer = any(req.indexer_topk is not None for req in self.running)
        out = self.runner.forward(chunks, lengths, want_routes=want_routes, want_indexer=want_indexer)
        temps = torch.tensor([req.params.temperature for req in self.running], dtype=torch.float32)
        logprobs = scaled_logprobs(out.last_logits, temps)
        tokens, chosen = sample_batch(logprobs, [r.params for r in self.running], [r.generator for r in self.running])
        for b, (req, token, logprob) in enumerate(zip(self.running, tokens, chosen)):
            if req.return_routes:
                req.routes[req.kv_len: req.kv_len + len(chunks[b])] = out.routes[b]
            if req.indexer_topk is not None:
                req.indexer_topk[req.kv_len: req.kv_len + len(chunks[b])] = out.indexer_topk[b]
            req.kv_len += len(chunks[b])
            req.output_ids.append(token)
            req.logprobs.append(logprob)
            req.versions.append(self.version)
            req.finish = self._finish_reason(req, token)
        finished = [req for req in self.running if req.finish is not None]
        self._remove_finished()
        self.last_output = time.monotonic()
        for req in finished:
            req.deliver(req)

    def _finish_reason(self, req: Request, token: int) -> Optional[dict]:
        if token in req.params.stop_token_ids or (token in self.eos and not req.params.ignore_eos):
            return {"type": "stop", "matched": token}
        if len(req.output_ids) >= req.params.max_new_tokens:
            return {"type": "length", "length": len(req.output_ids)}
        if len(req.tokens) >= self.runner.max_context:   # the next token would not fit
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _remove_finished(self) -> None:
        # descending: every row above `slot` is unfinished when `slot` is freed
        for slot in reversed(range(len(self.running))):
            if self.running[slot].finish is not None:
                self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        last = len(self.running) - 1
        if slot != last:
            moved = self.running[last]
            self.runner.cache.move_row(last, slot, moved.kv_len)
            self.running[slot] = moved
        self.running.pop()

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), "paused": self.paused,
                "weight_version": self.version, "health_checks_skipped": self.health_checks_skipped,
                "cancelled": self.cancelled,
                "running_output_tokens": sum(len(r.output_ids) for r in list(self.running))}
