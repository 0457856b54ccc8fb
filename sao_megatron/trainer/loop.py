"""The SAO loop, top to bottom: collect single rollouts -> critic values -> advantages -> K critic
updates -> one policy update (DIS) -> weight broadcast -> log -> checkpoint.

Baselines (grpo, gspo, dapo, ppo, ...) run through the same loop; the recipe's algorithm preset picks
the advantage estimator and the loss, and group mode asks the driver for n rollouts per prompt.
Rank 0 drives rollouts and engines; with several trainer ranks it shares each batch of samples with
the others, and every rank runs the model steps.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from sao_megatron.core.config import Recipe
from sao_megatron.core.records import Sample

from . import steps
from .batching import build_train_batches, response_tensors
from .services import Services


class Trainer:
    def __init__(self, recipe: Recipe, services: Services):
        self.recipe = recipe
        self.services = services
        self.step = 0                     # iterations done (critic warm-up included)
        self.version = 0                  # weight version the engines serve
        self.baseline = None              # running-mean reward baseline (advantage 'running_mean')
        self.warmup = recipe.critic.warmup_steps if recipe.critic.enabled else 0
        self.total = self.warmup + recipe.run.num_steps
        self.trains = recipe.run.debug != "rollout-only"   # rollout-only: collect and save, never update
        # One thread runs every model call, so the event loop keeps requests flowing meanwhile.
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="model", initializer=_enter_shim)

    async def on_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)

    async def train(self) -> None:
        try:
            await self.services.start(self)   # inside: a failed start still stops what it started
            await self.pretrain_value_model()
            while self.step < self.total and not self.services.preemption_requested():
                started = time.perf_counter()
                samples = await self.services.collect(self.recipe.rollout.batch_size, self.version)
                stats = steps.rollout_metrics(samples, self.version)
                if self.trains:
                    batches, prepared = await self.prepare(samples)
                    stats |= prepared | await self.update_critic(batches)
                    if self.step >= self.warmup:
                        stats |= await self.update_policy(batches)
                        stats |= await self.services.sync_weights(self.version + 1)
                        self.version += 1
                self.step += 1
                stats["perf/step_time_s"] = time.perf_counter() - started
                stats |= await self.services.maybe_evaluate(self.step)
                self.services.log(stats, self.step)
                await self.services.maybe_checkpoint(self.step, final=self.step == self.total)
        finally:
            await self.services.stop()
            self._model_thread.shutdown()

    async def prepare(self, samples: list[Sample]):
        """Critic values -> advantages and returns -> packed micro-batches."""
        resp = response_tensors(samples)
        seq_values = None
        if self.services.critic is not None:
            await self.make_resident("critic")
            probe = build_train_batches(samples, torch.zeros_like(resp.mask), None,
                                        self.recipe.parallel.micro_batch_tokens)
            seq_values = _rows_by_uid(probe, await self.on_model_thread(self.services.critic.compute_values, probe))
            seq_values = [seq_values[s.uid] for s in samples]
        advantages, returns, values, metrics = steps.compute_step_advantages(self.recipe.algorithm, samples, resp,
                                                                            seq_values, self.baseline)
        self.baseline = metrics.get("running_baseline", self.baseline)
        batches = build_train_batches(samples, advantages, returns, self.recipe.parallel.micro_batch_tokens)
        if values is not None:
            _attach_old_values(batches, samples, values)
        return batches, steps.prefixed("train", metrics)

    async def update_critic(self, batches) -> dict:
        critic = self.services.critic
        if critic is None:
            return {}
        loss_fn = steps.value_loss_fn(self.recipe.critic)
        stats = {}
        for _ in range(self.recipe.critic.updates_per_step):   # two-timescale: K critic updates
            stats = await self.on_model_thread(critic.train_step, self.services.my_share(batches), loss_fn)
        return steps.prefixed("critic", stats)

    async def update_policy(self, batches) -> dict:
        policy, algo = self.services.policy, self.recipe.algorithm
        await self.make_resident("policy")
        if algo.loss != "dis" and algo.mini_batches > 1:  # PPO-style losses need pi_old before any update
            for batch, (logp, _) in zip(batches, await self.on_model_thread(policy.compute_logprobs, batches)):
                batch.old_logprobs = logp
        loss_fn = steps.policy_loss_fn(algo, norm_len=float(self.recipe.rollout.max_new_tokens))
        stats = {}
        for part in _split(batches, algo.mini_batches):
            _rescale(part)
            stats = await self.on_model_thread(policy.train_step, self.services.my_share(part), loss_fn)
        return steps.prefixed("train", stats)

    async def make_resident(self, role: str) -> None:
        """critic.placement = swap: park the other model in host memory (it comes back when next used)."""
        if self.recipe.critic.placement != "swap" or self.services.critic is None:
            return
        other = self.services.policy if role == "critic" else self.services.critic
        await self.on_model_thread(other.park)

    async def pretrain_value_model(self) -> None:
        """Value pretraining on the initial policy's rollouts (critic only, weights never change)."""
        for index in range(self.recipe.critic.pretrain_steps if self.services.critic else 0):
            samples = await self.services.collect(self.recipe.rollout.batch_size, self.version)
            batches, _ = await self.prepare(samples)
            stats = await self.update_critic(batches)
            self.services.log({f"pretrain/{k.split('/')[-1]}": v for k, v in stats.items()}, -(index + 1))


def _enter_shim() -> None:
    from parallel.cpu_shim import enter_shim_in_this_thread

    enter_shim_in_this_thread()


def _rows_by_uid(batches, per_batch) -> dict:
    out = {}
    for batch, values in zip(batches, per_batch):
        for row, uid in enumerate(batch.sample_uids):
            out[uid] = values[row]
    return out


def _attach_old_values(batches, samples, values) -> None:
    index = {s.uid: i for i, s in enumerate(samples)}
    for batch in batches:
        old = torch.zeros_like(batch.returns)
        for row, uid in enumerate(batch.sample_uids):
            sample = samples[index[uid]]
            start, length = len(sample.prompt_ids), len(sample.response_ids)
            old[row, start:start + length] = values[index[uid], :length]
        batch.old_values = old


def _split(batches, parts: int):
    """Mini-batches: contiguous groups of micro-batches, one optimizer step each."""
    parts = max(1, min(parts, len(batches)))
    size = -(-len(batches) // parts)
    return [batches[i:i + size] for i in range(0, len(batches), size)]


def _rescale(part) -> None:
    """Each mini-batch is its own optimizer step: its loss normalises by its own global token count."""
    tokens = float(sum(b.loss_mask.sum().item() for b in part))
    seqs = float(sum(int((b.loss_mask.sum(dim=1) > 0).sum()) for b in part))
    for batch in part:
        batch.global_num_tokens, batch.global_num_seqs = tokens, seqs
