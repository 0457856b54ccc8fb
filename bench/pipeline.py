"""Async single-rollout pipeline vs synchronous group pipeline: samples/s and trainer idle fraction.

Both pipelines run the real RolloutDriver against the same SIMULATED engines (rollout/engines/scripted.py):
a request's latency is its length times ``token_time_s`` with at most ``slots`` requests decoding per
engine (continuous batching), and response lengths come from one long-tailed lognormal distribution
(capped at max_new_tokens). The trainer step is simulated as a fixed sleep per batch followed by an
in-place weight update. No model runs, so this measures the scheduling effect only:

- sync group (verl/slime-style synchronous GRPO): each step draws batch/n prompts x n rollouts, waits
  for the slowest one, then trains while the engines sit idle;
- async single (SAO): one rollout per prompt, requests always in flight, the trainer takes the oldest
  finished samples and the engines keep generating during the step; the staleness bound drops samples
  that got too old (their generation time is counted, their samples are not);
- async group: the same asynchronous pipeline with 8 rollouts per prompt (a group is ready when its last
  rollout is), so async single / async group isolates single rollouts and async group / sync group
  isolates asynchrony.

Reported: samples/s = used samples / wall time; trainer idle = time the trainer waited for data / wall.
"""
from __future__ import annotations

import asyncio
import math
import time

from checkpoints.init_model import build_tokenizer
from rollout.driver import RolloutDriver
from rollout.prompts import build_prompt_source
from rollout.engines.scripted import ScriptedEngine, lognormal_lengths
from sao_megatron.core.config.schema import RolloutConfig


def _settings(quick: bool) -> dict:
    return dict(engines=2, slots=16, token_time_s=0.004, median_len=40, sigma=1.0, max_new_tokens=512,
                batch=32, group_n=8, train_step_s=0.35, staleness_bound=8, samples=128 if quick else 512)


def _engines(p: dict, seed: int):
    lengths = lognormal_lengths(p["median_len"], p["sigma"])
    return [ScriptedEngine(f"sim{i}", token_time_s=p["token_time_s"], length_fn=lengths, seed=seed + i,
                            max_running=p["slots"], tokens_per_tick=8) for i in range(p["engines"])]


async def _train_step(driver, engines, p: dict, version: int) -> None:
    await asyncio.sleep(p["train_step_s"])
    async with driver.weight_update("in_place", version + 1):
        for e in engines:
            await e.update_weights_from_disk("simulated", version + 1)


async def _run_async(p: dict, tokenizer, group_n: int = 1) -> dict:
    """The asynchronous pipeline: one rollout per prompt (group_n = 1) or groups of group_n."""
    mode = {"mode": "single"} if group_n == 1 else {"mode": "group", "n_samples_per_prompt": group_n}
    cfg = RolloutConfig(task="arithmetic", batch_size=p["batch"], max_in_flight=p["engines"] * p["slots"],
                        max_new_tokens=p["max_new_tokens"], staleness_bound=p["staleness_bound"], temperature=1.0,
                        **mode)
    engines = _engines(p, seed=0)
    driver = RolloutDriver(engines, build_prompt_source(cfg, tokenizer, seed=0), lambda s: 0.0, cfg, tokenizer,
                           seed=0, buffer_capacity=4 * p["batch"] + cfg.max_in_flight)
    idle, version, first, first_idle, t0 = 0.0, 0, 0.0, 0.0, time.perf_counter()
    tokens0 = sum(e.tokens_generated for e in engines)
    await driver.start()
    for _ in range(p["samples"] // p["batch"]):
        w0 = time.perf_counter()
        await driver.get_batch(p["batch"], version)
        idle += time.perf_counter() - w0
        if not version:
            first, first_idle = time.perf_counter() - t0, idle
        await _train_step(driver, engines, p, version)
        version += 1
    wall = time.perf_counter() - t0
    metrics = driver.metrics()
    await driver.stop()
    return {"wall_s": wall, "samples_per_s": p["samples"] / wall, "trainer_idle": idle / wall,
            "trainer_idle_after_first_batch": (idle - first_idle) / (wall - first),
            "engine_tokens_per_s": (sum(e.tokens_generated for e in engines) - tokens0) / wall,
            "dropped_stale": metrics["rollout/dropped_stale"], "staleness_max_last": metrics["rollout/staleness_max"]}


async def _run_sync_group(p: dict, tokenizer) -> dict:
    cfg = RolloutConfig(task="arithmetic", mode="group", n_samples_per_prompt=p["group_n"], batch_size=p["batch"],
                        max_in_flight=p["batch"], max_new_tokens=p["max_new_tokens"], staleness_bound=10**6)
    engines = _engines(p, seed=0)
    source = build_prompt_source(cfg, tokenizer, seed=0)
    idle, first, first_idle, t0 = 0.0, 0.0, 0.0, time.perf_counter()
    for version in range(p["samples"] // p["batch"]):
        # capacity == batch: the driver draws exactly one batch and nothing runs during training
        driver = RolloutDriver(engines, source, lambda s: 0.0, cfg, tokenizer, seed=version, buffer_capacity=p["batch"])
        w0 = time.perf_counter()
        await driver.start()
        await driver.get_batch(p["batch"], version)
        idle += time.perf_counter() - w0
        if not version:
            first, first_idle = time.perf_counter() - t0, idle
        await _train_step(driver, engines, p, version)
        await driver.stop()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "samples_per_s": p["samples"] / wall, "trainer_idle": idle / wall,
            "trainer_idle_after_first_batch": (idle - first_idle) / (wall - first),
            "engine_tokens_per_s": sum(e.tokens_generated for e in engines) / wall}


def _length_stats(p: dict) -> dict:
    mu, s = math.log(p["median_len"]), p["sigma"]
    return {"median": p["median_len"], "mean": round(math.exp(mu + s * s / 2), 1),
            "p99": round(math.exp(mu + 2.326 * s), 1), "cap": p["max_new_tokens"]}


def run(quick: bool = False) -> dict:
    p = _settings(quick)
    tokenizer = build_tokenizer()
    sync = asyncio.run(_run_sync_group(p, tokenizer))
    async_ = asyncio.run(_run_async(p, tokenizer))
    async_group = asyncio.run(_run_async(p, tokenizer, group_n=p["group_n"]))
    speedup = async_["samples_per_s"] / sync["samples_per_s"]
    summary = (
        f"SIMULATED engines (latency = tokens x {p['token_time_s'] * 1e3:.0f} ms, {p['slots']} slots x "
        f"{p['engines']} engines, lognormal lengths {_length_stats(p)}), {p['samples']} samples, batch "
        f"{p['batch']}, simulated train step {p['train_step_s']} s:\n"
        f"  sync group (n={p['group_n']}): {sync['samples_per_s']:.1f} samples/s, trainer idle "
        f"{sync['trainer_idle']:.0%} ({sync['trainer_idle_after_first_batch']:.0%} after the first batch)\n"
        f"  async single: {async_['samples_per_s']:.1f} samples/s, trainer idle {async_['trainer_idle']:.0%} "
        f"({async_['trainer_idle_after_first_batch']:.0%} after the first batch, which fills the pipeline), "
        f"{async_['dropped_stale']} samples dropped stale (tau={p['staleness_bound']})\n"
        f"  async group (n={p['group_n']}): {async_group['samples_per_s']:.1f} samples/s, trainer idle "
        f"{async_group['trainer_idle_after_first_batch']:.0%} after the first batch, "
        f"{async_group['dropped_stale']} samples dropped stale\n"
        f"  asynchrony alone (async group / sync group) {async_group['samples_per_s'] / sync['samples_per_s']:.2f}x; "
        f"single rollout alone (async single / async group) {async_['samples_per_s'] / async_group['samples_per_s']:.2f}x\n"
        f"  engine tokens/s achieved: sync {sync['engine_tokens_per_s']:.0f}, async {async_['engine_tokens_per_s']:.0f} "
        f"(nominal peak {p['engines'] * p['slots'] / p['token_time_s']:.0f}; lower when this machine's CPUs are busy)\n"
        f"  ratio async/sync samples/s = {speedup:.2f}x (target >= 2.5x); steady-state trainer idle async "
        f"{async_['trainer_idle_after_first_batch']:.0%} (target < 15%)")
    return {"summary": summary, "settings": p, "sync_group": sync, "async_single": async_, "async_group": async_group,
            "speedup_samples_per_s": speedup, "simulated_engine": True}


if __name__ == "__main__":
    print(run(quick=True)["summary"])
