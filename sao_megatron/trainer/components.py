"""What the loop talks to, built once from the recipe: `build_components(recipe, rank, world_size)`.

The debug modes are decided here and nowhere else: rollout-only gets a sample source that saves
each batch, no critic, no weight updates and no training; train-only gets the saved rollouts as its
sample source and no engines. Rank 0 owns the rollout side (engines, sample source, metric sink).
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Optional, Union

import numpy as np
import torch

from rollout.sample_source import SampleSource
from sao_megatron.core.config import Recipe
from sao_megatron.metrics import MetricSink

from .checkpointing import Checkpoints
from .weight_updates import NoWeightUpdates, WeightUpdates


@dataclass(frozen=True)
class Components:
    """This rank's collaborators of the loop; none of them knows the loop."""

    rank: int
    world_size: int
    policy: Any                          # parallel.rl_model.RLModel
    critic: Optional[Any]                # RLModel, or None (critic off, or rollout-only)
    samples: Optional[SampleSource]      # rank 0 (the others receive its batches), else None
    weights: Union[WeightUpdates, NoWeightUpdates]
    checkpoints: Checkpoints
    trains: bool                         # False for rollout-only: collect and save, never update
    sink: Optional[MetricSink] = None    # rank 0
    tokenizer: Optional[Any] = None      # rank 0
    engines: list = field(default_factory=list)   # rank 0's engine clients (evaluation runs on them)
    reference: Optional[Any] = None      # RLModel "reference" (algorithm.kl_coef > 0), parked while idle

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


@contextlib.asynccontextmanager
async def build_components(recipe: Recipe, rank: int = 0, world_size: int = 1) -> AsyncIterator[Components]:
    """Build every component; on the way out (or when a later one fails to build) stop what was built:
    the sample source, then the engines, then the sink."""
    from sao_megatron.metrics.console import StartupPhases, missing_kernels_note, quiet_missing_kernel_warnings

    _seed_everything(recipe.run.seed + rank)
    quiet_missing_kernel_warnings()   # before Megatron is first imported; `sao doctor` explains them
    phases = StartupPhases(enabled=rank == 0 and recipe.logging.console)
    phases.note(missing_kernels_note(torch.cuda.is_available()))   # once per run, and only where it costs speed
    debug = recipe.run.debug
    async with contextlib.AsyncExitStack() as stack:
        with phases.phase("building models"):
            policy, critic, reference = _build_models(recipe, trains=debug != "rollout-only")
        tokenizer = sink = samples = restarts = None
        engines = []
        if rank == 0:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(recipe.model.path)
            sink = _build_sink(recipe, stack)
            if debug == "train-only":
                from rollout.dump import SavedRollouts

                samples = SavedRollouts(recipe.run.debug_dir)
            else:
                with phases.phase("starting engines"):
                    engines, samples, restarts = await _build_rollout(recipe, tokenizer, stack)
        driver = samples
        if debug == "rollout-only":
            from rollout.dump import DumpingSource

            samples = DumpingSource(samples, recipe.run_dir / "rollouts")
        weights = NoWeightUpdates()
        if debug == "none":
            from .weight_updates import build_weight_updates

            # restarts: every rank's sender regroups after an engine restart (weight_updates.py)
            weights = build_weight_updates(recipe, policy, engines, driver, rank, world_size, restarts)
            for client in weights.engines:   # a stage's or an owner's sender on another rank has its own clients
                if not any(client is engine for engine in engines or ()):
                    stack.push_async_callback(client.close)
        checkpoints = Checkpoints(recipe, rank, world_size, saves=debug == "none")
        if samples is not None:
            stack.push_async_callback(samples.stop)
        yield Components(rank, world_size, policy, critic, samples, weights, checkpoints, trains=debug != "rollout-only",
                         sink=sink, tokenizer=tokenizer, engines=engines, reference=reference)


def _build_models(recipe: Recipe, trains: bool):
    """Policy, critic (or None) and the KL reference (or None: kl_coef = 0, or a run that never trains)."""
    from parallel.rl_model import RLModel

    hf = _read_hf_weights(recipe.model.path)
    policy = RLModel.build(recipe, "policy")
    policy.load_hf_state_dict(hf)
    critic = reference = None
    if recipe.critic.enabled and trains:
        critic = RLModel.build(recipe, "critic")
        if recipe.critic.init_from_policy:
            critic.load_hf_state_dict(hf)
    if recipe.algorithm.kl_coef > 0 and trains:
        reference = RLModel.build(recipe, "reference")
        ref_path = recipe.algorithm.ref_model_path
        reference.load_hf_state_dict(_read_hf_weights(ref_path) if ref_path else hf)
        reference.park()   # host memory until the step's reference pass (parallel/offload.py)
    return policy, critic, reference


def _read_hf_weights(path) -> dict:
    from safetensors.torch import load_file

    hf = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        hf.update(load_file(shard))
    return hf


async def _build_rollout(recipe: Recipe, tokenizer, stack: contextlib.AsyncExitStack):
    """Rank 0's engines (closed, and stopped if started here, on the way out), the rollout driver, and
    the restarts of the engines started here (None when there are none, or rollout.engine_restarts = 0)."""
    from rollout.driver import RolloutDriver
    from rollout.prompts import build_prompt_source
    from sao_megatron.evaluation.agents import build_rollout_plugins

    from .engines import start_engines

    rollout = recipe.rollout
    engines, handles = await start_engines(recipe, recipe.run_dir)
    for handle in handles:   # the engine processes never outlive the run
        stack.callback(handle.stop)
    for engine in engines:
        stack.push_async_callback(engine.close)
    source = build_prompt_source(rollout, tokenizer, seed=recipe.run.seed, switch_every=rollout.env_switch_every)
    filters = []
    if recipe.algorithm.dynamic_sampling:  # DAPO: drop groups whose rewards are all equal
        from rollout.buffer import nonzero_reward_variance

        filters.append(nonzero_reward_variance)
    # rollout.agent / rollout.generate_fn: the multi-turn agent (and its reward) run on every prompt
    agent, reward_fn = build_rollout_plugins(rollout, tokenizer, recipe.model.max_seq_len)
    driver = RolloutDriver(engines, source, reward_fn, rollout, tokenizer, seed=recipe.run.seed, filters=filters,
                           agent=agent, context_length=recipe.model.max_seq_len)
    restarts = None
    if handles and rollout.engine_restarts > 0:
        from .engine_restarts import EngineRestarts

        restarts = EngineRestarts(recipe, engines, handles, driver, recipe.run_dir)
        restarts.start()
        stack.push_async_callback(restarts.stop)
    return engines, driver, restarts


def _build_sink(recipe: Recipe, stack: contextlib.AsyncExitStack):
    """The metric sink (wandb resumes its run id from the run dir); closed last, curves plotted then."""
    from sao_megatron.metrics import build_metric_sink

    from .state import total_steps

    from sao_megatron.metrics.rewind import rewind_metrics

    from .checkpointing import resumed_step

    marker = recipe.run_dir / "wandb_run_id"
    resume_id = marker.read_text().strip() if marker.exists() else ""
    resume_id = rewind_metrics(recipe.run_dir, resumed_step(recipe), resume_id)   # no step is logged twice
    sink = build_metric_sink(recipe.logging, recipe.run.name, recipe.run_dir, total_steps(recipe),
                             recipe.to_dict(), resume_id=resume_id)
    if sink.run_id:
        marker.write_text(sink.run_id)
    stack.callback(_close_sink, recipe, sink)
    return sink


def _close_sink(recipe: Recipe, sink) -> None:
    sink.close()
    if recipe.logging.plot:
        from sao_megatron.metrics.plot import plot_curves

        plot_curves(recipe.run_dir / "metrics.jsonl", recipe.run_dir / "curves.png", title=recipe.run.name)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)
