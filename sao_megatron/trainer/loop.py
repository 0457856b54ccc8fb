"""The SAO loop, top to bottom: collect single rollouts -> critic values -> advantages -> K critic
updates -> one policy update (DIS) -> weight broadcast -> log -> checkpoint.

Baselines (grpo, gspo, dapo, ppo, ...) run through the same loop; the recipe's algorithm preset picks
the advantage estimator and the loss, and group mode asks the driver for n rollouts per prompt.
Rank 0 drives rollouts and engines; with several trainer ranks it shares each batch of samples with
the others, and every rank runs the model steps. What the loop talks to comes built in `Components`
(components.py); where the run is lives in `TrainerState` (state.py), which checkpoints save.

Stopping (docs/reliability.md): a preemption signal is honoured between steps and during collection
(stopping.py); a rollout failure during collection stops the run with its one line. Either way, and
for any other error raised while the state is consistent (before the step's first model update, or
after the step), the last completed step is saved first: its model, and the driver's buffer and
in-flight samples, which a resume re-issues, so no sample is lost or trained on twice. A failure
before the first update saves the step's starting state, its batch back in the buffer (StepStart).
With several ranks the local parts of a step end at agreement points (agreement.py): one rank's
failure there stops every rank together, and all save; a failure inside a collective cannot be agreed.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from checkpoints.run_state import PREFIX as CHECKPOINT_PREFIX
from checkpoints.run_state import CheckpointWriteError
from sao_megatron.core.config import Recipe
from sao_megatron.core.records import Sample, TrainBatch

from . import steps
from .agreement import ErrorAgreement, RankFailed
from .batching import advantage_batch, gather_responses, pack_samples, with_advantages, with_counts
from .checkpointing import StepStart, checkpoint_parts, report_resume, step_start_parts
from .components import Components
from .speed import SpeedMeter, StepClock, engine_load_metrics
from .state import TrainerState, total_steps, warmup_steps
from .stopping import CollectionStopped, Stop, collect_until_stopped, share_batch


class Trainer:
    def __init__(self, recipe: Recipe, parts: Components, state: TrainerState):
        self.recipe, self.parts, self.state = recipe, parts, state
        self.warmup, self.total = warmup_steps(recipe), total_steps(recipe)
        # One thread runs every model call, so the event loop keeps requests flowing meanwhile.
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="model", initializer=_enter_shim)
        self.consistent = False    # True from a finished step (or the resume) to the next model update
        self.step_start: StepStart | None = None   # within a step, until its first model update
        self.stopped: CollectionStopped | None = None
        self.saved_at_stop = False   # whether a checkpoint of the last completed step exists after a stop
        self.preempted = False       # a preemption signal reached some rank (agreed at the step's end)
        self.where = "starting"      # what the step is doing, for the one line of a failure
        self.agreement = ErrorAgreement(parts.rank, parts.world_size, recipe.run_dir)
        self.clock = StepClock()     # this step's seconds per phase (speed.py)
        self.speed = SpeedMeter(getattr(parts.policy, "hf_config", None), parts.world_size)
        self.first_batch = parts.is_driver and recipe.logging.console   # announce the wait for it, once

    async def on_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)

    async def train(self) -> None:
        parts, state = self.parts, self.state
        try:
            await self.resume_and_start()
            await self.pretrain_value_model()
            self.consistent = True
            self.preempted = await self.agreed("after resuming")
            while state.step < self.total and not self.preempted:
                await self.train_step()
        except CollectionStopped as stop:
            self.saved_at_stop = await self.save_last_completed_step()
            if not stop.stop.preempted:
                raise
            self.stopped = stop
        except RankFailed as failed:   # agreed: every rank is here, at the same point
            try:
                failed.outcome = self._checkpoint_outcome(await self.save_last_completed_step(), agreed=True)
            except Exception as err:   # noqa: BLE001 - the save's own failure, named in the one line
                failed.outcome = f"the final save failed on rank {parts.rank}: {type(err).__name__}: {err}"
            raise
        except Exception as err:
            if parts.world_size == 1:
                if not isinstance(err, CheckpointWriteError):   # a save that failed is not tried again
                    await self.save_last_completed_step()
                raise
            # inside a collective region: the other ranks cannot join a save (agreement.py)
            failed = self.agreement.alone(err, self.where)
            failed.outcome = self._checkpoint_outcome(False, agreed=False)
            raise failed from err
        except BaseException:
            if parts.world_size == 1:
                await self.save_last_completed_step()
            raise
        finally:
            self._model_thread.shutdown()

    async def agreed(self, where: str, fn=None, *args):
        """Run local code (no collective; `fn` may be async), then meet the other ranks at an agreement
        point: a failure on any rank raises RankFailed on every rank. Returns fn's result; without fn,
        whether any rank got a preemption signal."""
        self.where = where
        result, error = None, None
        try:
            if fn is not None:
                result = fn(*args)
                if inspect.isawaitable(result):
                    result = await result
        except Exception as err:   # noqa: BLE001 - held for the agreement, raised on every rank there
            error = err
        point = (where, error, self.parts.checkpoints.preemption_flag())
        if self.parts.world_size == 1:   # no collective: no need to leave the event loop
            preempted = self.agreement.agree(*point)
        else:                            # the collective waits on the model thread; requests keep flowing
            preempted = await self.on_model_thread(self.agreement.agree, *point)
        return preempted if fn is None else result

    async def model_call(self, where: str, fn, *args):
        """A call that may hold collectives (model steps): run on the model thread."""
        self.where = where
        return await self.on_model_thread(fn, *args)

    def _checkpoint_outcome(self, saved: bool, agreed: bool) -> str:
        """The end of a failure's one line: what a resume will start from."""
        if not self.parts.checkpoints.saves:
            return "no checkpoint (this mode saves none)"
        latest = self.parts.checkpoints.checkpointer.latest()
        if saved:
            return f"the last completed step is saved, by every rank ({latest.name})"
        kept = f"the previous checkpoint {latest.name} is kept" if latest else "no checkpoint exists yet"
        if not agreed:
            return f"no final checkpoint (a failure inside a collective cannot be agreed; the models may be " \
                   f"mid-update); {kept}"
        return f"no final checkpoint (value pretraining saves none); {kept}"

    async def train_step(self) -> None:
        parts, state = self.parts, self.state
        started, version, stats, batches = time.perf_counter(), state.version, {}, None
        self.clock = StepClock()
        self.step_start = StepStart.take(state)
        with self.clock.phase("rollout_wait"):
            samples = await self.collect()
        self.step_start.batch = samples
        if parts.trains:
            batches, stats = await self.prepare(samples)
            self.consistent, self.step_start = False, None   # the models change from here to the step's end
            stats |= await self.update_critic(batches)
            if state.step >= self.warmup:
                stats |= await self.update_policy(batches)
                self.where = "syncing weights"
                with self.clock.phase("weight_sync"):
                    stats |= await parts.weights.sync(state.version + 1)
                state.version += 1
        state.step += 1
        self.consistent, self.step_start = True, None
        stats["perf/step_time_s"] = time.perf_counter() - started
        stats |= self.speed.step_metrics(self.clock, samples, stats["perf/step_time_s"], batches)
        self.preempted = await self.agreed("logging the step", self.report, samples, version, stats)
        self.where = "saving a checkpoint"
        await parts.checkpoints.maybe_save(state.step, state.step == self.total or self.preempted,
                                           checkpoint_parts(self.parts, state))

    async def report(self, samples: list[Sample], version: int, stats: dict) -> None:
        """Rollout metrics, evaluation and the log line of a finished step (rank 0's sink and engines)."""
        stats = steps.rollout_metrics(samples, version) | stats
        stats |= await engine_load_metrics(self.parts.engines)
        stats |= await self.maybe_evaluate()
        self.log(stats, self.state.step)

    async def save_last_completed_step(self) -> bool:
        """On a stop or a fatal error: save the last completed step unless the models are mid-update
        (then the previous checkpoint stands), or a checkpoint of it exists already. Within a step, before
        its first model update, that is the step's starting state (StepStart). Returns whether a
        checkpoint of the last completed step exists now."""
        checkpoints, step = self.parts.checkpoints, self.state.step
        if not (self.consistent and checkpoints.saves):
            return False
        latest = checkpoints.checkpointer.latest()
        if latest is not None and latest.name == f"{CHECKPOINT_PREFIX}{step:08d}":
            return True
        self.consistent = False    # a failure inside the save must not try again
        if self.step_start is None:
            parts = checkpoint_parts(self.parts, self.state)
        else:
            parts = step_start_parts(self.parts, self.step_start)
        self.where = "saving the last completed step"
        await checkpoints.maybe_save(step, True, parts)
        return True

    async def resume_and_start(self) -> None:
        """Continue from the latest checkpoint (if any), give the engines its weights, then start rollouts."""
        loaded = self.parts.checkpoints.resume(checkpoint_parts(self.parts, self.state))
        report_resume(loaded, self.state, self.parts.rank)
        for role, model in (("policy", self.parts.policy), ("critic", self.parts.critic)):
            if getattr(model, "lr", None) is not None:   # the learning-rate schedule continues where it was
                model.lr.resume_at(self.state.lr_steps.get(role, 0))
        if loaded is not None:
            await self.parts.weights.after_resume(self.state.version)
        if self.parts.samples is not None:
            await self.parts.samples.start()
            self.speed.start_counting(self.parts.samples.metrics())

    async def collect(self) -> list[Sample]:
        """Rank 0 gets finished samples from its sample source; the other ranks receive them."""
        if self.first_batch:
            from sao_megatron.metrics.console import StartupPhases

            self.first_batch = False
            with StartupPhases().phase("waiting for the first batch"):
                return await self.collect()
        samples, self.where = None, "collecting samples"
        if self.parts.samples is not None:
            try:
                samples = await collect_until_stopped(
                    self.parts.samples.get_batch(self.recipe.rollout.batch_size, self.state.version))
            except Exception as err:
                if self.parts.world_size == 1:
                    raise
                samples = Stop(self.agreement.describe(err, self.where), preempted=False)   # every rank stops
        self.where = "receiving the batch"
        return share_batch(samples, self.parts.world_size)

    async def prepare(self, samples: list[Sample]):
        """Pack the samples once -> critic values and reference logprobs on those batches -> advantages ->
        the batches with them. The local parts end at agreement points, before the model passes
        (collectives) and after."""
        packed = raw = kl = None
        if self.parts.critic is not None or self.needs_reference():
            packed = await self.agreed("packing the batch", pack_samples, samples,
                                       self.recipe.parallel.micro_batch_tokens, True,
                                       self.recipe.parallel.pack_sequences, self.recipe.algorithm.mini_batches)
        if self.parts.critic is not None:
            await self.make_resident("critic")
            with self.clock.phase("critic", passes=1):
                raw = await self.model_call("computing critic values", self.parts.critic.compute_values,
                                            packed.batches)
        if self.needs_reference():
            kl = await self.reference_logprobs(packed.batches)
        return await self.agreed("computing advantages", self.advantages, samples, packed, raw, kl)

    def needs_reference(self) -> bool:
        """KL to the reference this step: in the reward from the first step, in the loss on policy steps."""
        if self.parts.reference is None:
            return False
        return self.recipe.algorithm.kl_in == "reward" or self.state.step >= self.warmup

    async def reference_logprobs(self, batches: list[TrainBatch]) -> steps.ReferenceLogprobs:
        """The reference's logprobs of the batch (routes replayed as for the policy), then the reference
        goes back to host memory; with kl_in = reward also the policy's, for the penalty."""
        reference, policy_logp = self.parts.reference, None
        with self.clock.phase("logprobs", passes=1):
            ref = await self.model_call("computing reference logprobs", reference.compute_logprobs, batches)
            await self.model_call("parking the reference", reference.park)
        if self.recipe.algorithm.kl_in == "reward":
            await self.make_resident("policy")
            with self.clock.phase("logprobs", passes=1):
                policy_logp = await self.model_call("computing policy logprobs", self.parts.policy.compute_logprobs,
                                                    batches)
        return steps.ReferenceLogprobs([logp for logp, _ in ref],
                                       None if policy_logp is None else [logp for logp, _ in policy_logp])

    def advantages(self, samples: list[Sample], packed, raw_values, kl: steps.ReferenceLogprobs | None = None):
        """Advantages and returns into the packed batches (packing them first when no model pass did);
        the KL to the reference goes into the rewards or, as reference logprobs, into the batches."""
        packed = packed or pack_samples(samples, self.recipe.parallel.micro_batch_tokens,
                                        packed=self.recipe.parallel.pack_sequences,
                                        mini_batches=self.recipe.algorithm.mini_batches)
        values = None if raw_values is None else gather_responses(packed, raw_values)
        inputs = advantage_batch(samples, values, self.state.baseline)
        kl_metrics = {}
        if kl is not None and kl.policy is not None:
            inputs, kl_metrics = steps.kl_in_reward(self.recipe.algorithm, inputs, gather_responses(packed, kl.policy),
                                                    gather_responses(packed, kl.reference))
        advantages, returns, metrics = steps.compute_step_advantages(self.recipe.algorithm, inputs)
        self.state.baseline = metrics.get("running_baseline", self.state.baseline)
        batches = with_advantages(packed, advantages, returns, inputs.values)
        if kl is not None and kl.policy is None:   # kl_in = loss: the loss reads them (algorithms/compose.py)
            batches = [replace(batch, ref_logprobs=ref) for batch, ref in zip(batches, kl.reference)]
        return batches, steps.prefixed("train", metrics | kl_metrics)

    async def update_critic(self, batches: list[TrainBatch]) -> dict:
        critic = self.parts.critic
        if critic is None:
            return {}
        await self.make_resident("critic")   # kl_in = reward brought the policy back since the critic's values
        loss_fn = steps.value_loss_fn(self.recipe.critic)
        stats = {}
        for _ in range(self.recipe.critic.updates_per_step):   # two-timescale: K critic updates
            with self.clock.phase("critic", passes=3):
                stats = await self.model_call("updating the critic", critic.train_step, _my_share(batches), loss_fn)
        if getattr(critic, "lr", None) is not None:
            self.state.lr_steps["critic"] = critic.lr.steps
        return steps.prefixed("critic", stats)

    async def update_policy(self, batches: list[TrainBatch]) -> dict:
        policy, algo = self.parts.policy, self.recipe.algorithm
        await self.make_resident("policy")
        if algo.loss != "dis" and algo.mini_batches > 1:  # PPO-style losses need pi_old before any update
            with self.clock.phase("logprobs", passes=1):
                logps = await self.model_call("computing old logprobs", policy.compute_logprobs, batches)
            batches = [replace(batch, old_logprobs=logp) for batch, (logp, _) in zip(batches, logps)]
        loss_fn = steps.policy_loss_fn(algo, norm_len=float(self.recipe.rollout.max_new_tokens))
        stats = {}
        parts = _split(batches)
        for part in parts:
            # each mini-batch is its own optimizer step: its loss normalises by its own token count
            with self.clock.phase("policy", passes=3 if part is parts[-1] else 0):   # 3 passes over the batch
                stats = await self.model_call("updating the policy", policy.train_step,
                                              _my_share(with_counts(part)), loss_fn)
        if getattr(policy, "lr", None) is not None:
            self.state.lr_steps["policy"] = policy.lr.steps
        return steps.prefixed("train", steps.renamed_kl(stats))

    async def make_resident(self, role: str) -> None:
        """critic.placement = swap: park the other model in host memory (it comes back when next used)."""
        if self.recipe.critic.placement != "swap" or self.parts.critic is None:
            return
        other = self.parts.policy if role == "critic" else self.parts.critic
        await self.model_call(f"parking the {'policy' if role == 'critic' else 'critic'}", other.park)

    async def pretrain_value_model(self) -> None:
        """Value pretraining on the initial policy's rollouts (critic only, weights never change)."""
        for index in range(self.recipe.critic.pretrain_steps if self.parts.critic else 0):
            samples = await self.collect()
            batches, _ = await self.prepare(samples)
            stats = await self.update_critic(batches)
            self.log({f"pretrain/{k.split('/')[-1]}": v for k, v in stats.items()}, -(index + 1))

    async def maybe_evaluate(self) -> dict:
        """eval/<set>/avg@k and pass@k on the engines' current weights, every eval.interval steps."""
        cfg, step = self.recipe.eval, self.state.step
        if not (self.parts.engines and cfg.interval and cfg.datasets and step % cfg.interval == 0):
            return {}
        from sao_megatron.evaluation.runner import evaluate_all

        return await evaluate_all(self.parts.engines, self.parts.tokenizer, cfg, self.recipe.rollout,
                                  seed=self.recipe.run.seed, context_length=self.recipe.model.max_seq_len)

    def log(self, metrics: dict, step: int) -> None:
        if self.parts.sink is None:
            return
        if self.parts.samples is not None:
            source = self.parts.samples.metrics()
            metrics = {**source, "rollout/stale_drop_rate": self.speed.stale_drop_rate(source), **metrics}
        self.parts.sink.log(metrics, step)


def _enter_shim() -> None:
    from parallel.cpu_shim import enter_shim_in_this_thread

    enter_shim_in_this_thread()


def _my_share(batches: list[TrainBatch]) -> list[TrainBatch]:
    """The micro-batches this data-parallel rank trains on (forward-only passes see them all)."""
    from parallel.distributed import data_parallel_coords

    from .batching import shard_for_data_parallel

    return shard_for_data_parallel(batches, *data_parallel_coords())


def _split(batches: list[TrainBatch]) -> list[list[TrainBatch]]:
    """Mini-batches, one optimizer step each: the micro-batches of each sample group pack_samples made
    (TrainBatch.mini_batch), in order."""
    parts: dict[int, list[TrainBatch]] = {}
    for batch in batches:
        parts.setdefault(batch.mini_batch, []).append(batch)
    return [parts[k] for k in sorted(parts)]
