"""KL to a reference model in a real (tiny, CPU) trainer loop, and the learning-rate schedule it runs under.

A train-only run over saved samples (no engines): the reference is the initial policy, so the KL is
0 at the first policy step and grows as the policy moves away; the schedule's learning rate shows in
train/lr step by step, and a resumed run continues it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import pytest

from rollout.dump import DumpingSource, SavedRollouts
from sao_megatron.core.records import Sample, SampleStatus

PROMPT, RESPONSE = [5, 6, 7], [8, 9, 10, 11, 12, 13]


def _samples(step: int, n: int = 4, logprobs=None) -> list[Sample]:
    out = []
    for i in range(n):
        response = [(t + 3 * i + step) % 40 + 5 for t in RESPONSE]
        out.append(Sample(uid=f"s{step}-{i}", prompt_index=step * n + i, prompt_ids=PROMPT, response_ids=response,
                          loss_mask=[1] * len(response), rollout_logprobs=(logprobs or {}).get(i, [-1.0] * 6),
                          weight_versions=[0] * len(response), reward=float(i % 2),
                          status=SampleStatus.COMPLETED))
    return out


def _write(dump_dir, steps: int, logprobs_of=None) -> None:
    dumper = DumpingSource(None, dump_dir).dumper
    for step in range(steps):
        samples = _samples(step)
        if logprobs_of is not None:   # on-policy samples: the engine's logprobs are the initial policy's
            samples = _samples(step, logprobs=logprobs_of(samples))
        dumper.write(step, samples)


def _run(tiny_model_dir, tmp_path, steps: int, *extra, resume_dir=None, stop_after=None):
    """A train-only run of `steps` policy steps (stopped after `stop_after` of them); returns its metrics
    rows and trainer state."""
    from parallel.cpu_shim import enter_shim_in_this_thread
    from sao_megatron.core.config import load_recipe
    from sao_megatron.trainer.batching import pack_samples
    from sao_megatron.trainer.components import build_components
    from sao_megatron.trainer.loop import Trainer
    from sao_megatron.trainer.state import TrainerState

    placeholder = tmp_path / "placeholder"
    _write(placeholder, 1)
    recipe = load_recipe(None, [f"model.path='{tiny_model_dir}'", f"run.output_dir='{tmp_path}'", "run.name='kl'",
                                "run.debug='train-only'", f"run.debug_dir='{placeholder}'", f"run.num_steps={steps}",
                                "algorithm.name='running_mean'", "rollout.batch_size=4", "algorithm.lr=0.01",
                                "logging.wandb=false", "logging.plot=false", "logging.console=false",
                                "checkpoint.save_on_signal=false", *extra])
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    enter_shim_in_this_thread()

    async def train():
        async with build_components(recipe, 0, 1) as parts:
            def initial_logprobs(samples):
                packed = pack_samples(samples, recipe.parallel.micro_batch_tokens)
                logp = parts.policy.compute_logprobs(packed.batches)
                return {i: logp[s.batch][0][s.row, s.start:s.start + s.length].tolist()
                        for i, s in enumerate(packed.slots)}

            saved = tmp_path / "saved"
            if not saved.exists():
                _write(saved, 8, initial_logprobs)
            state = TrainerState()
            if resume_dir is not None:   # the schedule's place, as a checkpoint's trainer state holds it
                state.load_state_dict(json.loads(resume_dir.read_text()))
            parts = dataclasses.replace(parts, samples=SavedRollouts(saved))
            trainer = Trainer(recipe, parts, state)
            await trainer.resume_and_start()
            for _ in range(stop_after or steps):
                await trainer.train_step()
            return state

    state = asyncio.run(train())
    rows = [json.loads(line) for line in (recipe.run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, state


def test_kl_to_the_initial_policy_is_zero_at_step_one_and_grows(tiny_model_dir, tmp_path):
    rows, _ = _run(tiny_model_dir, tmp_path, 3, "algorithm.kl_coef=0.01", "algorithm.kl_estimator='low_var_kl'")
    kl = [row["train/ref_kl"] for row in rows]
    assert abs(kl[0]) < 1e-6, kl                     # the policy is the reference at step 1
    assert kl[1] > 1e-6 and kl[2] > kl[1], kl        # and moves away from it after
    for key in ("perf/time/rollout_wait_s", "perf/time/logprobs_s", "perf/time/critic_s", "perf/time/policy_s",
                "perf/time/weight_sync_s", "perf/tokens_per_s", "perf/train_tflops", "perf/pad_fraction",
                "rollout/stale_drop_rate"):
        assert all(key in row for row in rows), key
    assert all(row["perf/time/logprobs_s"] > 0 and row["perf/train_tflops"] > 0 for row in rows)


def test_kl_in_the_reward_trains_from_zero_kl_at_step_one(tiny_model_dir, tmp_path):
    rows, _ = _run(tiny_model_dir, tmp_path, 2, "algorithm.kl_coef=0.5", "algorithm.kl_in='reward'",
                   "algorithm.kl_estimator='k2'")
    assert abs(rows[0]["train/ref_kl"]) < 1e-6 and rows[1]["train/ref_kl"] > 1e-6


def test_warmup_then_cosine_decay_shows_in_train_lr_and_a_resume_continues_it(tiny_model_dir, tmp_path):
    lr, floor, warmup, steps = 0.01, 0.001, 2, 6
    schedule = [f"algorithm.lr={lr}", "algorithm.lr_schedule='cosine'", f"algorithm.lr_warmup_steps={warmup}",
                f"algorithm.lr_min={floor}"]

    def expected(k):   # optimizer step k of 1..steps (megatron/core/optimizer_param_scheduler.py:215 get_lr)
        if k <= warmup:
            return lr * k / warmup
        return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (steps - warmup)))

    rows, state = _run(tiny_model_dir, tmp_path / "whole", steps, *schedule)
    assert [row["train/lr"] for row in rows] == pytest.approx([expected(k) for k in range(1, steps + 1)])
    assert state.lr_steps == {"policy": steps}

    # a run stopped after 3 steps and resumed: the resumed run's steps 4..6 have the schedule's values
    _, first = _run(tiny_model_dir, tmp_path / "resumed", steps, *schedule, stop_after=3)
    saved = tmp_path / "trainer_state.json"
    saved.write_text(json.dumps(first.state_dict()))
    rows, _ = _run(tiny_model_dir, tmp_path / "resumed", steps, *schedule, stop_after=3, resume_dir=saved)
    assert [row["train/lr"] for row in rows[-3:]] == pytest.approx([expected(k) for k in (4, 5, 6)])


def test_the_critic_runs_its_own_schedule_over_its_updates(tiny_model_dir, tmp_path):
    # 3 steps x 2 critic updates = 6 critic optimizer steps, linear from 0.01 to 0.002 with no warm-up;
    # a step logs its last update's lr: optimizer steps 2, 4, 6 -> lr_min + (lr - lr_min) * (1 - k / 6)
    rows, state = _run(tiny_model_dir, tmp_path, 3, "algorithm.name='sao'", "critic.warmup_steps=0",
                       "critic.updates_per_step=2", "critic.lr=0.01", "critic.lr_schedule='linear'",
                       "critic.lr_min=0.002")
    assert [row["critic/lr"] for row in rows] == pytest.approx([0.002 + 0.008 * (1 - k / 6) for k in (2, 4, 6)])
    assert [row["train/lr"] for row in rows] == pytest.approx([0.01] * 3)   # the policy's stays constant
    assert state.lr_steps == {"critic": 6, "policy": 3}


def test_each_mini_batch_is_its_own_optimizer_step_even_when_the_batch_fits_one_micro_batch(tiny_model_dir, tmp_path):
    # GSPO's 4 mini-batches over a 4-sample batch that packs into one micro-batch: 4 optimizer steps a step
    # (they were 1, with the ratio exactly 1: GSPO silently became one on-policy step)
    rows, state = _run(tiny_model_dir, tmp_path, 2, "algorithm.name='gspo'", "rollout.n_samples_per_prompt=4")
    assert state.lr_steps["policy"] == 2 * 4
    assert all(row["train/ratio_max"] != 1.0 or row["train/ratio_min"] != 1.0 for row in rows)   # the last
    # mini-batch sees a policy that three updates moved from the recomputed old logprobs
