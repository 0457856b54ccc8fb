"""Everything the loop talks to, built from the recipe: models, engines, the rollout driver, weight
sync, metrics, checkpoints and preemption. The loop (loop.py) only calls the methods here.
"""
from __future__ import annotations

import contextlib
import json
import random
import time
import secrets
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from sao_megatron.core.config import Recipe
from sao_megatron.core.records import Sample


class Services:
    def __init__(self, recipe: Recipe, rank: int = 0, world_size: int = 1):
        self.recipe = recipe
        self.rank, self.world_size = rank, world_size
        self.is_driver = rank == 0
        self.run_dir = recipe.run_dir
        self.policy = self.critic = None
        self.engines, self.engine_handles = [], []
        self.driver = self.weight_sync = self.sink = self.checkpointer = None
        self.tokenizer = None

    # ------------------------------------------------------------------------------------ lifecycle
    async def start(self, trainer) -> None:
        recipe = self.recipe
        _seed_everything(recipe.run.seed + self.rank)
        self.trainer = trainer
        self.policy, self.critic = self._build_models()
        if self.is_driver:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(recipe.model.path)
            self.sink = self._build_sink()
            if recipe.run.debug == "train-only":
                from rollout.dump import SavedRollouts

                self.driver = SavedRollouts(recipe.run.debug_dir)   # same interface as the driver
            else:
                await self._build_rollout()
        await self._build_stage_senders()
        self._build_checkpointer()
        await self._maybe_resume()
        if self.driver is not None:
            await self.driver.start()

    async def stop(self) -> None:
        """Stop everything that was started, even when a step before failed half-way."""
        try:
            if self.driver is not None:
                await self.driver.stop()
            for engine in self.engines:
                await engine.close()
        finally:
            for handle in self.engine_handles:  # the engine processes never outlive the run
                handle.stop()
        if self.sink is not None:
            self.sink.close()
            if self.recipe.logging.plot:
                from sao_megatron.metrics.plot import plot_curves

                plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png", title=self.recipe.run.name)

    def _build_models(self):
        from parallel.rl_model import RLModel
        from safetensors.torch import load_file

        hf = {}
        for shard in sorted(Path(self.recipe.model.path).glob("*.safetensors")):
            hf.update(load_file(shard))
        policy = RLModel.build(self.recipe, "policy")
        policy.load_hf_state_dict(hf)
        critic = None
        if self.recipe.critic.enabled and self.recipe.run.debug != "rollout-only":
            critic = RLModel.build(self.recipe, "critic")
            if self.recipe.critic.init_from_policy:
                critic.load_hf_state_dict(hf)
        return policy, critic

    async def _build_rollout(self) -> None:
        from rollout.driver import RolloutDriver
        from rollout.prompts import build_prompt_source
        from rollout.rewards import resolve_reward_fn

        recipe, rollout = self.recipe, self.recipe.rollout
        self.engines, self.engine_handles = await start_engines(recipe, self.run_dir)
        source = build_prompt_source(rollout, self.tokenizer, seed=recipe.run.seed,
                                     switch_every=rollout.env_switch_every)
        filters = []
        if recipe.algorithm.dynamic_sampling:  # DAPO: drop groups whose rewards are all equal
            from rollout.buffer import nonzero_reward_variance

            filters.append(nonzero_reward_variance)
        self.driver = RolloutDriver(self.engines, source, resolve_reward_fn(rollout), rollout, self.tokenizer,
                                    seed=recipe.run.seed, filters=filters)
        if recipe.run.debug != "rollout-only":
            self.weight_sync = self._new_weight_sync(stage=0)

    def _build_sink(self):
        from sao_megatron.metrics import build_metric_sink

        resume_id = ""
        marker = self.run_dir / "wandb_run_id"
        if marker.exists():
            resume_id = marker.read_text().strip()
        sink = build_metric_sink(self.recipe.logging, self.recipe.run.name, self.run_dir, self.trainer.total,
                                 self.recipe.to_dict(), resume_id=resume_id)
        if sink.run_id:
            marker.write_text(sink.run_id)
        return sink

    # ------------------------------------------------------------------------------------ per step
    async def collect(self, num_samples: int, version: int) -> list[Sample]:
        """Rank 0 gets finished samples from the driver (or the saved rollouts); others receive them."""
        samples = None
        if self.is_driver:
            samples = await self.driver.get_batch(num_samples, version)
            if self.recipe.run.debug == "rollout-only":
                from rollout.dump import RolloutDumper

                RolloutDumper(self.run_dir / "rollouts").write(self.trainer.step, samples)
        return _share(samples, self.world_size)

    def my_share(self, batches):
        """The micro-batches this data-parallel rank trains on (forward-only passes see them all)."""
        from parallel.distributed import data_parallel_coords

        from .batching import shard_for_data_parallel

        return shard_for_data_parallel(batches, *data_parallel_coords())

    async def sync_weights(self, version: int) -> dict:
        """Broadcast the new policy weights to every engine under `version`, engines paused meanwhile."""
        if self.recipe.run.debug != "none":
            return {}
        started = time.perf_counter()
        sent_before = getattr(self.weight_sync, "bytes_sent", 0)
        await self._update_weights(version, pause=True)
        metrics = {"perf/weight_sync_s": time.perf_counter() - started}
        if hasattr(self.weight_sync, "bytes_sent"):   # what this rank sent (its stage's share with per-stage senders)
            metrics["perf/weight_sync_sent_mb"] = (self.weight_sync.bytes_sent - sent_before) / 2**20
        return metrics

    async def _update_weights(self, version: int, pause: bool) -> None:
        """One update window for all stages, owned by the driver rank (docs/weights.md).

        The driver rank pauses the engines through the rollout driver (it tracks in-flight requests;
        ``pause=False`` when nothing runs yet, at resume) and opens ONE weight-update session per
        engine; only then may any rank's sender send: a stage sending before the pause would queue
        behind frozen requests, one sending before the session would be refused. push_weights ends
        when every stage has landed; then the sessions close and the caches settle before resuming.
        """
        async with contextlib.AsyncExitStack() as window:
            if self.is_driver:
                try:
                    await self._open_window(window, version, pause)
                except BaseException as err:
                    self._senders_go(error=f"{type(err).__name__}: {err}")
                    raise
            self._senders_go()
            await self.push_weights(version)

    async def _open_window(self, window: contextlib.AsyncExitStack, version: int, pause: bool) -> None:
        if pause:
            await window.enter_async_context(self.driver.weight_update(self.recipe.weight_sync.pause_mode))
        else:   # idle engines: settle (flush, new namespace) after the session closes
            from checkpoints.weight_sync import settle_caches

            window.push_async_callback(settle_caches, self.engines, version, True, self.recipe.weight_sync.timeout_s)
        if self.weight_sync is not None:
            await window.enter_async_context(self.weight_sync.update_session())

    def _senders_go(self, error: Optional[str] = None) -> None:
        """Every rank waits here for the driver rank's window; its failure fails every rank (no hang)."""
        if self.world_size == 1:
            return
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and not self.is_driver:
            raise RuntimeError(f"rank {self.rank}: the driver rank could not open the weight update: {box[0]}")

    def per_stage_senders(self) -> bool:
        """Each pipeline stage's first rank broadcasts its own layers (weight_sync.senders = per_stage)."""
        ws = self.recipe.weight_sync
        return (self.world_size > 1 and self.recipe.parallel.pp > 1 and ws.method == "broadcast"
                and ws.senders == "per_stage" and self.recipe.run.debug == "none")

    async def push_weights(self, version: int) -> None:
        """Every rank takes part in gathering the HF-named tensors; the senders send them.

        One sender (rank 0) gets every stage's tensors; with per-stage senders each stage's first rank
        sends only its stage's, one stage after the other: an engine receives one update at a time
        (SGLang's scheduler blocks in the broadcast), so two stages sending at once could each hold
        an engine the other needs, a deadlock (slime serializes its stage senders with a lock for
        the same reason). After each turn the ranks agree that it landed, so a failed push fails
        every rank instead of a hang, and the driver closes the sessions only after the last stage.
        """
        if not self.per_stage_senders():
            await self._push_turn(self.policy.export_hf(scope="all"), version)
        else:
            from parallel.distributed import pipeline_stage_group

            my_stage = pipeline_stage_group()[0]
            for stage in range(self.recipe.parallel.pp):
                await self._push_turn(self.policy.export_hf(scope="stage") if stage == my_stage else None, version)
        if self.recipe.weight_sync.check_equal:
            from checkpoints.weight_check import check_weight_update_equal

            await check_weight_update_equal(self.engines if self.is_driver else [], self.policy.export_hf())

    async def _push_turn(self, named, version: int) -> None:
        """One turn: the senders send `named` (None: not this rank's turn), every rank of the turn
        drains it, then all ranks agree that it landed."""
        error = None
        try:
            if named is not None and self.weight_sync is not None:
                await self.weight_sync.push(named, version)
        except Exception as err:   # noqa: BLE001 - shared with every rank below, then re-raised
            if self.world_size == 1:
                raise
            error = err
        for _ in named or ():   # no sender here, or one that failed mid-stream: keep the export's collectives in step
            pass
        if self.world_size > 1:
            _all_pushes_landed(error, self.rank)

    async def _build_stage_senders(self) -> None:
        """With per-stage senders, rank 0 shares the engines' endpoints and every other stage's first
        rank builds its own weight sync (group `sao_weights_pp<stage>_...`) to the same engines."""
        if not self.per_stage_senders():
            return
        import torch.distributed as dist

        from parallel.distributed import pipeline_stage_group

        box = [{"urls": [e.url for e in self.engines], "api_key": self.engines[0].api_key} if self.is_driver else None]
        dist.broadcast_object_list(box, src=0)
        stage, _, index = pipeline_stage_group()
        if self.is_driver or index != 0:
            return
        self.engines = engine_clients(self.recipe, box[0]["urls"], box[0]["api_key"])
        self.weight_sync = self._new_weight_sync(stage=stage)

    def _new_weight_sync(self, stage: int):
        """This rank's sender to every engine; the driver rank owns the update window (manage_pause=False)."""
        from checkpoints.weight_sync import build_weight_sync

        recipe = self.recipe
        extra = {"aux_from": recipe.model.path} if recipe.weight_sync.method == "disk" else {"stage": stage}
        return build_weight_sync(recipe.weight_sync, self.engines, run_dir=self.run_dir, manage_pause=False,
                                 ranks_per_engine=recipe.rollout.engine_tp, **extra)

    async def maybe_evaluate(self, step: int) -> dict:
        """eval/<set>/avg@k and pass@k on the engines' current weights, every eval.interval steps."""
        cfg = self.recipe.eval
        if not (self.is_driver and cfg.interval and cfg.datasets and step % cfg.interval == 0 and self.engines):
            return {}
        from sao_megatron.evaluation.runner import evaluate_all

        return await evaluate_all(self.engines, self.tokenizer, cfg, self.recipe.rollout, seed=self.recipe.run.seed)

    def log(self, metrics: dict, step: int) -> None:
        if self.sink is None:
            return
        if self.driver is not None:
            metrics = {**self.driver.metrics(), **metrics}
        self.sink.log(metrics, step)

    # ------------------------------------------------------------------------------------ checkpoints
    def _build_checkpointer(self) -> None:
        from checkpoints.preemption import install_preemption_handlers
        from checkpoints.run_state import RunCheckpointer

        if self.recipe.checkpoint.save_on_signal:
            install_preemption_handlers()
        self.checkpointer = RunCheckpointer(self.run_dir / "checkpoints", keep_last=self.recipe.checkpoint.keep_last,
                                            rank=self.rank, world_size=self.world_size)

    def _components(self) -> dict:
        parts = {"policy": self.policy, "trainer": _TrainerState(self.trainer), "rng": _RngState()}
        if self.critic is not None:
            parts["critic"] = self.critic
        if self.driver is not None:
            parts["driver"] = self.driver
        return parts

    async def maybe_checkpoint(self, step: int, final: bool) -> None:
        interval = self.recipe.checkpoint.interval
        due = final or (interval and step % interval == 0) or self.preemption_requested()
        if due and self.recipe.run.debug == "none":
            self.checkpointer.save(step, self._components())

    async def _maybe_resume(self) -> None:
        resume = self.recipe.checkpoint.resume
        if resume == "never":
            return
        path = None if resume == "auto" else Path(resume)
        loaded = self.checkpointer.load(self._components(), path=path)
        if loaded is None:
            return
        if self.is_driver:
            print(f"resumed from {loaded} at step {self.trainer.step}, weight version {self.trainer.version}",
                  file=sys.stderr)
        if self.trainer.version > 0 and self.recipe.run.debug == "none":
            # The engines start from the initial weights: give them the resumed policy before any
            # request runs (the driver has not started yet, so there is nothing to pause).
            await self._update_weights(self.trainer.version, pause=False)

    def preemption_requested(self) -> bool:
        from checkpoints.preemption import should_checkpoint_and_exit

        # With several ranks a signal may reach only some of them: agree, so all stop at the same step.
        return should_checkpoint_and_exit(sync=self.world_size > 1)


class _TrainerState:
    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        return {"step": self.trainer.step, "version": self.trainer.version, "baseline": self.trainer.baseline}

    def load_state_dict(self, state: dict) -> None:
        self.trainer.step, self.trainer.version = int(state["step"]), int(state["version"])
        self.trainer.baseline = state.get("baseline")


class _RngState:
    def state_dict(self) -> dict:
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


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


def _share(samples, world_size: int):
    if world_size == 1:
        return samples
    import torch.distributed as dist

    box = [samples]
    dist.broadcast_object_list(box, src=0)
    return box[0]


async def start_engines(recipe: Recipe, run_dir: Path):
    """Connect to recipe.rollout.engine_urls, or start num_engines local engines. Returns (engines, handles)."""
    rollout = recipe.rollout
    api_key = rollout.api_key or secrets.token_hex(16)
    handles = []
    urls = list(rollout.engine_urls)
    if not urls:
        try:
            for index in range(rollout.num_engines):
                handle = _launch_engine(recipe, index, api_key, run_dir)
                handles.append(handle)
                urls.append(handle.url)
        except BaseException:
            for handle in handles:  # a later engine failed to start: stop the earlier ones
                handle.stop()
            raise
    engines = engine_clients(recipe, urls, api_key)
    (run_dir / "engines.json").write_text(json.dumps({"urls": urls}))
    return engines, handles


def engine_clients(recipe: Recipe, urls: list[str], api_key: str) -> list:
    """One SGLangEngine per URL, told the routes' shape from the model's config.json (SGLang does not
    report it); the same for the driver's clients and every stage sender's."""
    from rollout.sglang_client import SGLangEngine, route_shape_from_config

    shape = route_shape_from_config(recipe.model.path)
    return [SGLangEngine(url, api_key=api_key, name=f"engine{i}@{url}", timeout_s=recipe.rollout.request_timeout_s,
                         **shape) for i, url in enumerate(urls)]


def _launch_engine(recipe: Recipe, index: int, api_key: str, run_dir: Path):
    rollout = recipe.rollout
    port = rollout.port + index if rollout.port else 0
    if rollout.engine == "reference":
        from rollout.reference_server import launch_local

        # --tp N: the server joins the weight-update group as N ranks, as an SGLang engine with tp N does
        extra = ["--tp", str(rollout.engine_tp)] if rollout.engine_tp > 1 else None
        return launch_local(Path(recipe.model.path).resolve(), host=rollout.host, port=port, api_key=api_key,
                            log_path=run_dir / f"engine{index}.log", seed=recipe.run.seed + index, extra_args=extra)
    from rollout.sglang_launcher import launch_sglang

    return launch_sglang(recipe, index=index, port=port, api_key=api_key, log_path=run_dir / f"engine{index}.log")
