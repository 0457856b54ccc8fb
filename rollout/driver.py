"""RolloutDriver: keeps requests in flight across engines and streams rewarded samples to training.

How it works (one asyncio event loop, the trainer's):
- Work items are Samples. `single` mode makes one per prompt (uid ``p<prompt_index>``); `group` mode
  makes n (uids ``p<i>-<k>``, sharing ``group_id = i``). Each runs in its own task: generate (one
  segment, or a multi-turn agent loop) -> reward -> buffer.
- Up to ``rollout.max_in_flight`` items run at once, each placed on the least-loaded live engine;
  new prompts are drawn only while the buffer has room (bounded memory), and a sample starts only
  if it can still be trained within ``rollout.staleness_bound`` given the samples ahead of it and the
  trainer's pace (rollout/staleness.py `admission_room`), so finished work is not thrown away.
- A failed engine call (EngineError, timeout, connection error) marks the engine dead and retries the
  request on another engine under a new request id ``<uid>-a<attempt>``; the old id is aborted, and a
  late answer to it is never read, so nothing is lost or duplicated. A background probe brings
  engines back when their health check passes. All engines down for ``engine_down_timeout_s``
  (rollout.engine_down_timeout_s) fails the run. An engine that stops answering, its process alive
  (no request finished and /health failing for ``engine_down_timeout_s``), is taken for dead and
  its requests are re-issued, rather than waiting out ``request_timeout_s``.
- A failure that never clears (sampling values every engine rejects, a reward that always times out)
  would otherwise fail sample after sample forever: ``max_failed_in_a_row`` samples failing one after
  another (rollout.max_failed_in_a_row) stop the run with one line naming the last cause. One sample
  that finishes resets the count, so transient failures keep retrying.
- Weight updates (`weight_update(mode)`): engines pause; in "abort"/"retract" mode running requests
  are ended and their partial outputs kept, then resumed after the update as continuations
  (prompt + partial output) under the new weights, so every token's version is exact. In
  "in_place" mode requests keep running; see rollout/staleness.py for how tokens are tagged.
- get_batch applies the staleness bound to ready samples (drop or regenerate) and returns the
  oldest whole groups.
- ``context_length`` (model.max_seq_len) caps every request's max_new_tokens so prompt + response
  never passes it (SGLang answers such a request 400); a prompt that alone does not fit fails.
- Any unexpected exception in a worker task is stored and re-raised by the next get_batch.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional

from rollout.batch_metrics import batch_metrics
from rollout.buffer import GroupFilter, SampleBuffer
from rollout.context import PromptTooLong, fit_max_new_tokens
from rollout.engines.engine import EngineError, GenerateRequest, GenerateResult, Generator, settle_prefix_cache
from rollout.engines.health import ENGINE_FAILURES, DriverError, EngineHealth, rejected
from rollout.rewards.base import apply_reward
from rollout.staleness import StalenessControl, StalenessStats, token_versions
from sao_megatron.core.records import Sample, SampleStatus

log = logging.getLogger(__name__)

UPDATE_MODES = ("in_place", "retract", "abort")


class RolloutDriver(EngineHealth, StalenessControl):
    """The rollout side of the trainer: samples in, batches out, and the one owner of pause/resume
    (`weight_update`). Engine health (pick, mark dead, probe) is its part in rollout/engines/health.py;
    admission and the staleness bound its part in rollout/staleness.py."""

    def __init__(self, engines: list[Generator], prompt_source, reward_fn, cfg, tokenizer, *, seed: int,
                 filters: Iterable[GroupFilter] = (), buffer_capacity: Optional[int] = None, agent=None,
                 max_attempts: int = 0, probe_interval_s: float = 1.0, stall_timeout_s: Optional[float] = None,
                 control_timeout_s: float = 30.0, return_routed_experts: bool = True,
                 context_length: Optional[int] = None, staleness_admission: bool = True):
        if not engines:
            raise ValueError("RolloutDriver needs at least one engine; set rollout.num_engines or engine_urls")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}; give each engine its own name/url")
        self.engines = {e.name: e for e in engines}
        self.prompt_source, self.reward_fn, self.cfg = prompt_source, reward_fn, cfg
        self.tokenizer, self.seed, self.agent = tokenizer, seed, agent
        self.group_size = cfg.n_samples_per_prompt if cfg.mode == "group" else 1
        capacity = buffer_capacity or max(4 * cfg.batch_size, cfg.batch_size + cfg.max_in_flight) + self.group_size
        self.buffer = SampleBuffer(self.group_size, capacity, filters)
        self.max_attempts = max_attempts or 3 * len(engines)
        self.probe_interval_s, self.control_timeout_s = probe_interval_s, control_timeout_s
        self.stall_timeout_s = stall_timeout_s or (cfg.request_timeout_s + cfg.reward_timeout_s + 60.0)
        self.engine_down_timeout_s = min(getattr(cfg, "engine_down_timeout_s", 60.0), self.stall_timeout_s)
        self.max_failed_in_a_row = getattr(cfg, "max_failed_in_a_row", 0) or max(2 * cfg.max_in_flight, 8)
        self.return_routed_experts = return_routed_experts
        # False: start work whenever the buffer has room (the old rule; benchmarks compare against it)
        self.staleness_admission = staleness_admission
        self._pace = cfg.batch_size                   # samples the trainer takes per step
        self._next_version: Optional[int] = None      # trainer version of the next batch (None = current)
        self._wanted = 0                              # samples a waiting get_batch still needs
        self.context_length = context_length          # model.max_seq_len: no request may pass it
        self.stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

        self._pending: deque[Sample] = deque()       # drawn, waiting for a slot
        self._active: dict[str, Sample] = {}         # uid -> sample owned by a running task
        self._tasks: dict[str, asyncio.Task] = {}
        self._load = {n: 0 for n in names}
        self._dead: set[str] = set()
        self._restarting: set[str] = set()           # engines/health.py: restarts in progress
        self._awaiting_weights: set[str] = set()     # restarted, kept out until a weight update
        self._versions = {n: 0 for n in names}       # engine version as last known by the driver
        self._current_version = 0
        self._resumed: Optional[asyncio.Event] = None
        self._progress: Optional[asyncio.Event] = None
        self._update_lock: Optional[asyncio.Lock] = None
        self._probe_task: Optional[asyncio.Task] = None
        self._watch_task: Optional[asyncio.Task] = None
        self._calls: dict[str, set[asyncio.Future]] = {n: set() for n in names}   # generate calls per engine
        self._answered = {n: 0.0 for n in names}     # when each engine last answered a generate call
        self._executor: Optional[ThreadPoolExecutor] = None
        self._error: Optional[BaseException] = None
        self._running = False
        self._started_at = 0.0
        self.stats = StalenessStats()
        self.counts = {"finished": 0, "failed": 0, "engine_errors": 0, "continuations": 0}
        self.failed_in_a_row = 0
        self._last_batch: list[Sample] = []
        self._last_version = 0                       # the trainer version _last_batch was handed out for
        self.recent_failures: deque[tuple[str, str]] = deque(maxlen=64)   # (uid, reason), newest last

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._running:
            raise DriverError("RolloutDriver.start() called twice")
        self._resumed, self._progress, self._update_lock = asyncio.Event(), asyncio.Event(), asyncio.Lock()
        self._resumed.set()
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")
        for name, engine in self.engines.items():
            self._versions[name] = await self._control(engine, engine.weight_version())
        self._running, self._started_at = True, time.monotonic()
        self._probe_task = asyncio.create_task(self._probe_loop(), name="rollout-probe")
        self._watch_task = asyncio.create_task(self._watch_live(), name="rollout-liveness")
        self._fill()

    async def stop(self) -> None:
        """Cancel running work (kept as pending in state_dict) and abort its requests on the engines."""
        self._running = False
        tasks = list(self._tasks.values()) + [t for t in (self._probe_task, self._watch_task) if t]
        await _cancel_all(tasks)
        self._pending.extendleft(reversed(list(self._active.values())))
        self._active.clear()
        for name, engine in self.engines.items():
            if name not in self._dead:
                with contextlib.suppress(*ENGINE_FAILURES):
                    await asyncio.wait_for(engine.abort(None), self.control_timeout_s)
        if self._executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- the trainer's side ---------------------------------------------------------------------
    async def get_batch(self, num_samples: int, current_version: int, *, max_tokens: Optional[int] = None) -> list[Sample]:
        """`num_samples` rewarded samples (whole groups) within the staleness bound, oldest first.

        With ``max_tokens`` the batch is token-budgeted instead: it waits until `num_samples` samples
        or `max_tokens` tokens are ready and returns the oldest whole groups that fit the budget
        (at least one group).
        """
        if not self._running:
            raise DriverError("get_batch before start() (or after stop()); await driver.start() first")
        if num_samples % self.group_size:
            raise ValueError(f"get_batch({num_samples}) is not a multiple of the group size {self.group_size}; "
                             "make rollout.batch_size a multiple of rollout.n_samples_per_prompt")
        if num_samples > self.buffer.capacity:
            raise ValueError(f"get_batch({num_samples}) does not fit the buffer (capacity {self.buffer.capacity}); "
                             "pass a larger buffer_capacity")
        self._current_version = self._next_version = current_version
        last_progress = time.monotonic()
        while True:
            self._apply_staleness_bound()
            # a batch already collected is served even when collection has since failed: its samples
            # are good and the step they make is saved; the failure is raised on the next call
            if self._batch_ready(num_samples, max_tokens):
                batch = self.buffer.pop(num_samples) if max_tokens is None else self.buffer.pop(max_tokens=max_tokens)
                self._last_batch, self._last_version, self._wanted = batch, current_version, 0
                # the next batch is at most one version newer (a step without a policy update keeps it)
                self._pace, self._next_version = len(batch), current_version + 1
                self._fill()
                return batch
            self._raise_if_failed()
            self._wanted = num_samples
            self._fill()
            self._progress.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._progress.wait(), timeout=min(1.0, self.stall_timeout_s))
                last_progress = time.monotonic()
            if not self._resumed.is_set():
                last_progress = time.monotonic()       # a weight update in progress is not a stall
            if time.monotonic() - last_progress > self.stall_timeout_s:
                raise DriverError(self._stall_message())

    def _batch_ready(self, num_samples: int, max_tokens: Optional[int]) -> bool:
        if self.buffer.num_ready >= num_samples:
            return True
        return max_tokens is not None and self.buffer.num_ready > 0 and self.buffer.ready_tokens() >= max_tokens

    @contextlib.asynccontextmanager
    async def weight_update(self, mode: str, version: Optional[int] = None):
        """Pause the engines for a weight update, yield, then resume under the new version (caches settled).

        The one owner of pause/resume: weight sync never pauses (rollout/weights/base.py). ``mode`` is
        ``weight_sync.pause_mode``. ``version`` is the new weight version; when omitted each engine is
        asked for its own after the update.
        """
        if mode not in UPDATE_MODES:
            raise ValueError(f"weight_update mode {mode!r}; use one of {UPDATE_MODES}")
        async with self._update_lock:
            self._resumed.clear()
            live = [e for n, e in self.engines.items() if n not in self._dead]
            await asyncio.gather(*(self._control(e, e.pause(mode)) for e in live))
            if mode == "retract":      # end the retracted requests; their partial outputs are resumed
                await asyncio.gather(*(self._control(e, e.abort(None)) for e in live))
            try:
                yield
            finally:
                await self._after_update(live, version, mode)

    async def _after_update(self, live: list[Generator], version: Optional[int], mode: str) -> None:
        for engine in live:
            self._versions[engine.name] = (version if version is not None
                                           else await self._control(engine, engine.weight_version()))
        # No request may reuse KV of the old weights: new namespace; flushed unless paused in place (engines/engine.py).
        flush = mode != "in_place"
        await asyncio.gather(*(self._control(e, settle_prefix_cache(e, self._versions[e.name], flush)) for e in live))
        await asyncio.gather(*(self._control(e, e.resume()) for e in live))
        await self._catch_up(max((self._versions[e.name] for e in live), default=version))
        self._resumed.set()
        self._fill()

    # ---- scheduling -----------------------------------------------------------------------------
    def _fill(self) -> None:
        """Start work until max_in_flight, the buffer's room, or the engines are used up."""
        if not self._running or self._error is not None or not self._resumed.is_set():
            return
        while len(self._active) < self.cfg.max_in_flight:
            if self._admission_room() < (1 if self._pending else self.group_size):
                return
            if not self._pending:
                if self.buffer.room() - len(self._active) < self.group_size:
                    return
                self._pending.extend(self._draw_prompt())
            sample = self._pending.popleft()
            self._active[sample.uid] = sample
            self._tasks[sample.uid] = asyncio.create_task(self._run(sample), name=f"rollout-{sample.uid}")

    def _draw_prompt(self) -> list[Sample]:
        prompt = self.prompt_source.next()
        samples = []
        for k in range(self.group_size):
            uid = f"p{prompt.prompt_index}" if self.group_size == 1 else f"p{prompt.prompt_index}-{k}"
            samples.append(Sample(uid=uid, prompt_index=prompt.prompt_index, prompt_ids=list(prompt.prompt_ids),
                                  group_id=prompt.prompt_index, prompt_text=prompt.prompt_text,
                                  label=prompt.label, metadata=copy.deepcopy(prompt.metadata)))
        return samples

    async def _run(self, sample: Sample) -> None:
        try:
            if sample.status in (SampleStatus.PENDING, SampleStatus.ABORTED):
                await self._generate(sample)
            if sample.status != SampleStatus.FAILED and sample.reward is None:
                sample.metadata["env_step"] = self._current_version
                await apply_reward(self.reward_fn, sample, self.cfg.reward_timeout_s, self._executor)
            self._finish(sample)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug in a worker: fail the run loudly, never hang
            log.exception("rollout worker for %s crashed", sample.uid)
            self._error = exc
            self._progress.set()
        finally:
            self._tasks.pop(sample.uid, None)

    def _finish(self, sample: Sample) -> None:
        del self._active[sample.uid]
        if sample.status == SampleStatus.FAILED:
            self.counts["failed"] += 1
            self.recent_failures.append((sample.uid, sample.metadata.get("error", "")))
            self._count_failure_in_a_row(sample)
        else:
            self.counts["finished"] += 1
            self.failed_in_a_row = 0
        self.buffer.put(sample)
        self._progress.set()
        self._fill()

    # ---- generation -----------------------------------------------------------------------------
    async def _generate(self, sample: Sample) -> None:
        if self.agent is not None:
            await self.agent.rollout(sample, self.generate_turn, self.tokenizer)
            return
        remaining = self.cfg.max_new_tokens - len(sample.response_ids)
        finish = await self.generate_turn(sample, remaining, self.stop_ids) if remaining > 0 else "length"
        if finish == "failed":
            return
        sample.status = SampleStatus.COMPLETED if finish == "stop" else SampleStatus.TRUNCATED
        sample.response_text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)

    async def generate_turn(self, sample: Sample, max_new_tokens: int, stop_ids: list[int]) -> str:
        """Generate one segment (loss_mask 1) onto the sample; continue it across aborts.

        Returns "stop", "length", or "failed" (sample marked FAILED with the reason).
        """
        start_len, aborts = len(sample.response_ids), 0
        while True:
            remaining = max_new_tokens - (len(sample.response_ids) - start_len)
            try:   # SGLang refuses prompt + max_new_tokens past the context: cap it (rollout/context.py)
                remaining = fit_max_new_tokens(len(sample.prompt_ids), sample.num_tokens, remaining,
                                               self.context_length)
            except PromptTooLong as exc:
                return self._fail(sample, str(exc))
            if remaining <= 0:
                return "length"
            await self._resumed.wait()
            result = await self._call_engines(sample, remaining, stop_ids)
            if result is None:
                return "failed"
            if result.finish_reason != "abort":
                return "stop" if result.finish_reason == "stop" else "length"
            sample.status = SampleStatus.ABORTED
            self.counts["continuations"] += 1
            aborts = 0 if result.output_ids else aborts + 1
            if aborts > self.max_attempts:
                return self._fail(sample, f"aborted {aborts} times in a row without progress")

    async def _call_engines(self, sample: Sample, max_new_tokens: int, stop_ids: list[int]) -> Optional[GenerateResult]:
        last_error, tries = "", 0
        for tries in range(1, self.max_attempts + 1):
            engine = await self._pick_engine()
            attempt = sample.metadata.get("attempts", 0)
            sample.metadata["attempts"] = attempt + 1
            request = self._request(sample, f"{sample.uid}-a{attempt}", max_new_tokens, stop_ids)
            submit_version = self._versions[engine.name]
            self._load[engine.name] += 1
            try:
                result = await self._generate_on(engine, request)
                self._append(sample, result, submit_version)
                return result
            except ENGINE_FAILURES as exc:
                last_error = f"{engine.name}: {type(exc).__name__}: {exc}"
                if rejected(exc):   # the engine is fine; every engine would refuse the same request
                    break
                await self._engine_failed(engine, request.rid, last_error)
            finally:
                self._load[engine.name] -= 1
        self._fail(sample, f"generation failed after {tries} attempt(s); last error {last_error}")
        return None

    def _request(self, sample: Sample, rid: str, max_new_tokens: int, stop_ids: list[int]) -> GenerateRequest:
        seed = zlib.crc32(f"{self.seed}:{rid}".encode())
        return GenerateRequest(rid=rid, input_ids=sample.prompt_ids + sample.response_ids,
                               max_new_tokens=max_new_tokens, temperature=self.cfg.temperature,
                               top_p=self.cfg.top_p, top_k=self.cfg.top_k, seed=seed,
                               stop_token_ids=list(stop_ids), return_routed_experts=self.return_routed_experts)

    def _append(self, sample: Sample, result: GenerateResult, submit_version: int) -> None:
        """Commit an engine result to the sample (all per-token lists grow together)."""
        n = len(result.output_ids)
        if len(result.output_logprobs) != n:
            raise EngineError(f"engine {result.engine}: request {result.rid} returned {n} tokens but "
                              f"{len(result.output_logprobs)} logprobs")
        versions = token_versions(result, submit_version)
        sample.response_ids.extend(int(t) for t in result.output_ids)
        sample.rollout_logprobs.extend(float(x) for x in result.output_logprobs)
        sample.loss_mask.extend([1] * n)
        sample.weight_versions.extend(versions)
        routes = result.routed_experts
        sample.routed_experts = routes if routes is not None and routes.shape[0] == sample.num_tokens - 1 else None
        chosen = result.indexer_topk
        sample.indexer_topk = chosen if chosen is not None and chosen.shape[0] == sample.num_tokens - 1 else None
        sample.metadata["engine"] = result.engine or sample.metadata.get("engine", "")

    def _count_failure_in_a_row(self, sample: Sample) -> None:
        """A cause that fails every sample stops the run (one line, the last reason) instead of
        drawing prompt after prompt forever; the sample still goes to the buffer (counted as dropped)."""
        self.failed_in_a_row += 1
        if self.failed_in_a_row >= self.max_failed_in_a_row and self._error is None:
            reason = sample.metadata.get("error", "") or "no reason recorded"
            self._error = DriverError(f"{self.failed_in_a_row} samples failed in a row "
                                      f"(rollout.max_failed_in_a_row={self.max_failed_in_a_row}); last: {reason}")

    def _fail(self, sample: Sample, reason: str) -> str:
        sample.status = SampleStatus.FAILED
        sample.metadata["error"] = reason
        log.warning("sample %s failed: %s", sample.uid, reason)
        return "failed"

    # ---- errors, metrics, resume -----------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if isinstance(self._error, DriverError):   # a known cause: its one line says it all
            raise DriverError(str(self._error))
        if self._error is not None:
            raise DriverError(f"rollout worker failed: {type(self._error).__name__}: {self._error}") from self._error

    def metrics(self) -> dict:
        """The last batch's numbers (rollout/batch_metrics.py) and the driver's own: counts, drops, load."""
        batch = self._last_batch
        elapsed = max(time.monotonic() - self._started_at, 1e-9) if self._started_at else 0.0
        out = batch_metrics(batch, self._last_version) | {
            "rollout/dropped_stale": self.stats.dropped, "rollout/finished": self.counts["finished"],
            "rollout/failed": self.counts["failed"], "rollout/admission_room": self._admission_room(),
            "rollout/dropped_filtered": self.buffer.dropped_filtered,
            "rollout/samples_per_s": self.counts["finished"] / elapsed if elapsed else 0.0,
            "rollout/in_flight": len(self._active), "rollout/buffered": self.buffer.num_ready,
            "rollout/engine_errors": self.counts["engine_errors"],
        }
        phases = [s.reward_info["env_phase"] for s in batch if "env_phase" in s.reward_info]
        if phases:
            out["env/phase"] = phases[-1]
        return out

    def state_dict(self) -> dict:
        """Everything to resume without losing or duplicating a prompt: in-flight samples are saved
        as they were after their last committed engine result and restart from there."""
        work = [s.work_state() for s in list(self._active.values()) + list(self._pending)]
        return {"prompt_source": self.prompt_source.state_dict(), "buffer": self.buffer.state_dict(),
                "work": work, "counts": dict(self.counts),
                "dropped_stale": self.stats.dropped, "current_version": self._current_version,
                "next_version": self._next_version}

    def load_state_dict(self, state: dict) -> None:
        if self._running:
            raise DriverError("load_state_dict must be called before start()")
        self.prompt_source.load_state_dict(state["prompt_source"])
        self.buffer.load_state_dict(state["buffer"])
        self._pending = deque(Sample.from_dict(d) for d in state["work"])
        self.counts.update(state["counts"])
        self.stats.dropped = state["dropped_stale"]
        self._current_version = state["current_version"]
        self._next_version = state.get("next_version")


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancel and await tasks. Re-cancels, because asyncio.wait_for before Python 3.12 can swallow a
    cancellation that races with its inner call finishing."""
    pending = [t for t in tasks if not t.done()]
    while pending:
        for task in pending:
            task.cancel()
        _, still = await asyncio.wait(pending, timeout=0.5)
        pending = list(still)
    for task in tasks:      # retrieve results so no 'exception was never retrieved' noise
        if not task.cancelled():
            task.exception()
