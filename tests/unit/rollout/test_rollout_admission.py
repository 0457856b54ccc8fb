"""Staleness-aware admission (rollout/staleness.py `admission_room`): the driver starts only what the
trainer can still take within the bound, so finished generations are not thrown away as stale.

Time here is counted in event-loop turns, not seconds: the scripted engine makes one token per turn
(token_time_s=0 sleeps 0), the reward is async (no threads) and a train step is a fixed number of
turns, so both drivers are compared on the same deterministic clock.
"""
from __future__ import annotations

import asyncio

import pytest

from checkpoints.init_model import build_tokenizer
from rollout.driver import RolloutDriver
from rollout.prompts import build_prompt_source
from rollout.engines.scripted import ScriptedEngine
from rollout.staleness import admission_room
from sao_megatron.core.config.schema import RolloutConfig

TOK = build_tokenizer()
STEPS, BATCH, BOUND, TRAIN_TURNS = 12, 16, 2, 120


async def _reward(sample) -> float:
    return 1.0


async def _run(staleness_admission: bool, mode: str = "single", pause_mode: str = "in_place"):
    group = 4 if mode == "group" else 1
    cfg = RolloutConfig(task="arithmetic", mode=mode, n_samples_per_prompt=group, batch_size=BATCH,
                        max_in_flight=BATCH, max_new_tokens=8, staleness_bound=BOUND, stale_policy="drop")
    engine = ScriptedEngine("e0", token_time_s=0.0, length_fn=lambda rng: rng.randint(3, 8), seed=0)
    source = build_prompt_source(cfg, TOK, seed=0, num_problems=256)
    driver = RolloutDriver([engine], source, _reward, cfg, TOK, seed=0, staleness_admission=staleness_admission)
    turns, running = 0, True

    async def clock():           # one count per event-loop turn: the test's own time
        nonlocal turns
        while running:
            turns += 1
            await asyncio.sleep(0)

    clock_task = asyncio.create_task(clock())
    await driver.start()
    trained, worst = 0, 0
    for version in range(STEPS):
        batch = await driver.get_batch(BATCH, version)
        trained += len(batch)
        worst = max(worst, max(s.staleness(version) for s in batch))
        for _ in range(TRAIN_TURNS):           # the train step: generation goes on meanwhile
            await asyncio.sleep(0)
        async with driver.weight_update(pause_mode, version + 1):
            engine.version = version + 1
    metrics = driver.metrics()
    running = False
    await driver.stop()
    await clock_task
    return {"dropped": metrics["rollout/dropped_stale"], "finished": metrics["rollout/finished"],
            "per_turn": trained / turns, "worst": worst}


@pytest.mark.parametrize("mode,pause_mode", [("single", "in_place"), ("group", "retract")])
def test_admission_drops_almost_nothing_where_buffer_room_alone_drops_many(mode, pause_mode):
    old = asyncio.run(_run(False, mode, pause_mode))
    new = asyncio.run(_run(True, mode, pause_mode))
    assert old["dropped"] / old["finished"] > 0.2            # generation ran ahead and was thrown away
    assert new["dropped"] / new["finished"] <= 0.05
    assert new["per_turn"] >= 0.95 * old["per_turn"]         # the trainer is fed as fast as before
    assert old["worst"] <= BOUND and new["worst"] <= BOUND


def test_admission_room_counts_versions_pace_and_work_ahead():
    # trainer waiting for the batch of version 3, engines at 3: up to (bound + 1) batches ahead
    assert admission_room(bound=2, engine_version=3, next_train_version=3, pace=16, ahead=0) == 48
    # trainer training version 3 (its next batch is version 4's), engines still at 3: one batch fewer
    assert admission_room(bound=2, engine_version=3, next_train_version=4, pace=16, ahead=10) == 22
    # bound 0 is synchronous: nothing starts while the trainer trains
    assert admission_room(bound=0, engine_version=3, next_train_version=4, pace=16, ahead=0) == 0
