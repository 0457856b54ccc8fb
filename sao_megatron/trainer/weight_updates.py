"""The policy's new weights reach the engines: one update window per version (docs/weights.md).

`WeightUpdates` is what the loop calls after each policy step (`sync`) and after a resume
(`after_resume`). The debug modes train without engines or never train: they get `NoWeightUpdates`.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Optional

from sao_megatron.core.config import Recipe

if TYPE_CHECKING:
    from rollout.weights.plan import SenderRole, WeightPlan


class NoWeightUpdates:
    """No engine serves the policy (run.debug = rollout-only or train-only): nothing to send."""

    async def sync(self, version: int) -> dict:
        return {}

    async def after_resume(self, version: int) -> None:
        pass


class WeightUpdates:
    """This rank's part in every weight update: the driver rank (rank 0) owns the window (pause the
    engines through `driver`, one session per engine), the senders push, every rank gathers."""

    def __init__(self, recipe: Recipe, policy, engines: list, driver, sender, rank: int = 0, world_size: int = 1,
                 plan: Optional[WeightPlan] = None, restarts=None):
        self.recipe, self.policy, self.engines, self.driver = recipe, policy, engines, driver
        self.weight_sync = sender            # None on ranks that do not send
        self.restarts = restarts             # engine_restarts.EngineRestarts on the driver rank, if any
        self.rank, self.world_size, self.is_driver = rank, world_size, rank == 0
        self.plan = plan or plan_for(recipe, world_size)
        self.restarts_seen = 0               # engine restarts this rank's sender has formed its group after

    async def sync(self, version: int) -> dict:
        """Broadcast the new policy weights to every engine under `version`, engines paused meanwhile."""
        started = time.perf_counter()
        sent_before = getattr(self.weight_sync, "bytes_sent", 0)
        await self._update_weights(version, pause=True)
        metrics = {"perf/weight_sync_s": time.perf_counter() - started}
        if hasattr(self.weight_sync, "bytes_sent"):   # what this rank sent (its stage's share with per-stage senders)
            metrics["perf/weight_sync_sent_mb"] = (self.weight_sync.bytes_sent - sent_before) / 2**20
        return metrics

    async def after_resume(self, version: int) -> None:
        """The engines start from the initial weights: give them the resumed policy before any request
        runs (the driver has not started yet, so there is nothing to pause)."""
        if version > 0:
            await self._update_weights(version, pause=False)

    async def _update_weights(self, version: int, pause: bool) -> None:
        """One update window for all stages, owned by the driver rank (docs/weights.md).

        The driver rank pauses the engines through the rollout driver (it tracks in-flight requests;
        ``pause=False`` when nothing runs yet, at resume) and opens ONE weight-update session per
        engine; only then may any rank's sender send: a stage sending before the pause would queue
        behind frozen requests, one sending before the session would be refused. push_weights ends
        when every stage has landed; then the sessions close and the caches settle before resuming.
        """
        async with contextlib.AsyncExitStack() as window:
            restarted = 0
            if self.is_driver:
                try:
                    if self.restarts is not None:   # a restarting engine joins this update, not half of it
                        await self.restarts.settled.wait()
                        restarted = len(self.restarts.restarts)
                    await self._open_window(window, version, pause)
                except BaseException as err:
                    self._senders_go(restarted, error=f"{type(err).__name__}: {err}")
                    raise
            self._regroup_after_restarts(self._senders_go(restarted))
            await self.push_weights(version)

    async def _open_window(self, window: contextlib.AsyncExitStack, version: int, pause: bool) -> None:
        if pause:
            await window.enter_async_context(self.driver.weight_update(self.recipe.weight_sync.pause_mode))
        else:   # idle engines: settle (flush, new namespace) after the session closes
            from rollout.weights import settle_caches

            window.push_async_callback(settle_caches, self.engines, version, True, self.recipe.weight_sync.timeout_s)
        if self.weight_sync is not None:
            await window.enter_async_context(self.weight_sync.update_session())

    def _senders_go(self, restarted: int, error: Optional[str] = None) -> int:
        """Every rank waits here for the driver rank's window; its failure fails every rank (no hang).
        Returns the driver rank's count of engine restarts so far (only it watches the engines)."""
        if self.world_size == 1:
            return restarted
        import torch.distributed as dist

        box = [(error, restarted)]
        dist.broadcast_object_list(box, src=0)
        error, restarted = box[0]
        if error is not None and not self.is_driver:
            raise RuntimeError(f"rank {self.rank}: the driver rank could not open the weight update: {error}")
        return restarted

    def _regroup_after_restarts(self, restarted: int) -> None:
        """A restarted engine is a new process in none of the senders' groups: after a restart every
        sender (each stage's, with per-stage senders, not only the driver rank's) forms its group anew."""
        if restarted != self.restarts_seen and self.weight_sync is not None:
            self.weight_sync.regroup()
        self.restarts_seen = restarted

    async def push_weights(self, version: int) -> None:
        """Every rank takes part in gathering the HF-named tensors; the senders send them.

        One sender (rank 0) gets every stage's tensors; with per-stage senders each stage's first rank
        sends only its stage's, one stage after the other: an engine receives one update at a time
        (SGLang's scheduler blocks in the broadcast), so two stages sending at once could each hold
        an engine the other needs, a deadlock (slime serializes its stage senders with a lock for
        the same reason). After each turn the ranks agree that it landed, so a failed push fails
        every rank instead of a hang, and the driver closes the sessions only after the last stage.
        """
        role = self.plan.role(self.rank)   # its export scope and stage (rollout/weights/plan.py)
        if self.plan.turns == "per_stage":
            for stage in range(self.plan.pp):
                await self._push_turn(self.policy.export_hf(scope=role.scope, snapshot=role.snapshot) if stage == role.stage else None, version)
        else:
            await self._push_turn(self.policy.export_hf(scope=role.scope, snapshot=role.snapshot), version)
        if self.plan.turns == "shares":
            # shard writes land in each engine rank's memory, one-sided: no engine blocks in a receive,
            # so every rank sent its share at once; the driver labels the version after all landed
            await self._label_turn(version)
        if self.recipe.weight_sync.check_equal:
            from rollout.weights import check_weight_update_equal

            from .engines import engine_fp8_layout

            named, fp8 = self.policy.export_hf(), engine_fp8_layout(self.recipe)
            if fp8 is not None:   # an FP8 engine serves each FP8 weight as its dequantized blocks
                from rollout.weights.fp8_blocks import round_trip_stream

                named = round_trip_stream(named, fp8)
            await check_weight_update_equal(self.engines if self.is_driver else [], named)

    async def _push_turn(self, named, version: int) -> None:
        """One turn: the senders send `named` (None: not this rank's turn), every rank of the turn
        drains it, then all ranks agree that it landed."""
        sends = named is not None and self.weight_sync is not None
        await self._agreed((lambda: self.weight_sync.push(named, version)) if sends else None, drain=named or ())

    async def _label_turn(self, version: int) -> None:
        """The driver labels the version on every engine once every rank's writes landed; all ranks
        agree on the outcome, as after a push."""
        await self._agreed((lambda: self.weight_sync.label_version(version)) if self.is_driver else None)

    async def _agreed(self, call, drain=()) -> None:
        """Await `call()` (None: nothing for this rank), drain `drain` (a sender that failed mid-stream,
        or none here: the export's collectives stay in step), then all ranks agree: an error on any
        rank raises on every rank instead of a hang."""
        error = None
        try:
            if call is not None:
                await call()
        except Exception as err:   # noqa: BLE001 - shared with every rank below, then re-raised
            if self.world_size == 1:
                raise
            error = err
        for _ in drain:
            pass
        if self.world_size > 1:
            _all_pushes_landed(error, self.rank)


def plan_for(recipe: Recipe, world_size: int) -> WeightPlan:
    """The run's weight-update plan (rollout/weights/plan.py): every rank's sender role, decided once."""
    from rollout.weights.plan import plan_from_recipe

    return plan_from_recipe(recipe, world_size)


def build_weight_updates(recipe: Recipe, policy, engines: list, driver, rank: int, world_size: int,
                         restarts=None) -> WeightUpdates:
    """This rank's part as the plan gives it: a sender to the engines when its role sends (the driver
    rank's own clients; another sender's clients to the driver rank's engine URLs), else none."""
    plan = plan_for(recipe, world_size)
    role = plan.role(rank)
    if plan.shares_endpoints:   # a collective: every rank takes part, sender or not
        endpoints = _shared_endpoints(engines, rank)
        if role.sends and rank != 0:
            from .engines import engine_clients

            engines = engine_clients(recipe, endpoints["urls"], endpoints["api_key"])
    sender = new_weight_sync(recipe, engines, role) if role.sends else None
    return WeightUpdates(recipe, policy, engines, driver, sender, rank, world_size, plan, restarts)


def _shared_endpoints(engines: list, rank: int) -> dict:
    """Rank 0's engine URLs and API key, on every rank (a collective: every rank calls it)."""
    import torch.distributed as dist

    box = [{"urls": [e.url for e in engines], "api_key": engines[0].api_key} if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def new_weight_sync(recipe: Recipe, engines: list, role: Optional[SenderRole] = None):
    """A sender to every engine in `role` (default: the lone driver-rank sender); the driver rank owns
    the update window (the push never pauses)."""
    from rollout.weights import build_weight_sync
    from rollout.weights.factory import DRIVER

    from .engines import engine_fp8_layout, engine_weight_dtype

    # FP8 engines take 128x128 FP8 blocks + scales (rollout/weights/fp8_blocks.py)
    fp8 = engine_fp8_layout(recipe) if recipe.rollout.engine_fp8 else None
    return build_weight_sync(recipe.weight_sync, engines, run_dir=recipe.run_dir, role=role or DRIVER,
                             ranks_per_engine=recipe.rollout.engine_tp, fp8=fp8, aux_from=recipe.model.path,
                             dtype=engine_weight_dtype(recipe))   # bf16 engines take bf16 tensors only


def _all_pushes_landed(error: Optional[BaseException], rank: int) -> None:
    """Every rank learns whether every rank's push landed; any failure raises on all of them."""
    import torch.distributed as dist

    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(r, msg) for r, msg in enumerate(outcomes) if msg is not None]
    if error is not None:
        raise error
    if failed:
        r, msg = failed[0]
        raise RuntimeError(f"rank {rank}: the weight push of rank {r} failed: {msg}")
