"""rollout/* numbers of a batch: computed by one function, the same whether the driver, a saved-rollout
source or the trainer's step reports them."""
from __future__ import annotations

import asyncio

import pytest

from checkpoints.init_model import build_tokenizer
from rollout.batch_metrics import KEYS, batch_metrics
from rollout.driver import RolloutDriver
from rollout.dump import RolloutDumper, SavedRollouts
from rollout.engines.scripted import ScriptedEngine
from rollout.prompts import build_prompt_source
from rollout.rewards import resolve_reward_fn
from sao_megatron.core.config.schema import RolloutConfig
from sao_megatron.core.records import Sample, SampleStatus
from sao_megatron.trainer.steps import rollout_metrics


def sample(i, reward, n_tokens, versions, status=SampleStatus.COMPLETED, **metadata):
    return Sample(uid=f"p{i}", prompt_index=i, prompt_ids=[1], response_ids=[5] * n_tokens,
                  loss_mask=[1] * n_tokens, rollout_logprobs=[0.0] * n_tokens, weight_versions=versions,
                  reward=reward, status=status, metadata=metadata)


def test_batch_metrics_by_hand():
    batch = [sample(0, 1.0, 2, [3, 3]), sample(1, 0.0, 4, [1, 2, 3, 3], turns=3),
             sample(2, 0.5, 6, [2] * 6, SampleStatus.TRUNCATED), sample(3, None, 0, [])]
    m = batch_metrics(batch, version=3)
    assert set(m) == set(KEYS)
    assert m["rollout/raw_reward"] == pytest.approx(1.5 / 4)                     # no reward counts as 0
    assert m["rollout/raw_reward_std"] == pytest.approx((11 / 48) ** 0.5)         # unbiased: sum sq dev 11/16, n-1 = 3
    assert m["rollout/accuracy"] == 0.25                                          # reward >= 1 without reward_info
    assert m["rollout/response_len"] == 3.0 and m["rollout/response_len_max"] == 6.0
    assert m["rollout/turns"] == 1.5                                              # 1 + 3 + 1 + 1
    assert m["rollout/staleness"] == 0.75 and m["rollout/staleness_max"] == 2.0   # 0, 2, 1, 0 (no tokens)
    assert m["rollout/truncated_frac"] == 0.25


def test_no_samples_yet_is_zeros_and_one_sample_has_no_spread():
    assert batch_metrics([], version=5) == dict.fromkeys(KEYS, 0.0)
    assert batch_metrics([sample(0, 0.7, 3, [4, 4, 4])], version=5)["rollout/raw_reward_std"] == 0.0


def test_driver_and_trainer_step_report_the_same_numbers():
    async def main():
        cfg = RolloutConfig(task="arithmetic", batch_size=8, max_in_flight=8, max_new_tokens=12, staleness_bound=100)
        tokenizer = build_tokenizer()
        engines = [ScriptedEngine(f"e{i}", seed=i, token_time_s=0.0005) for i in range(2)]
        d = RolloutDriver(engines, build_prompt_source(cfg, tokenizer, seed=0, num_problems=64),
                          resolve_reward_fn(cfg), cfg, tokenizer, seed=0)
        await d.start()
        await d.get_batch(8, current_version=0)
        batch = await d.get_batch(8, current_version=3)
        metrics = d.metrics()
        await d.stop()
        return batch, metrics

    batch, metrics = asyncio.run(main())
    step = rollout_metrics(batch, 3)
    assert step["rollout/staleness"] == 3.0            # generated under version 0, trained at 3
    assert {k: metrics[k] for k in KEYS} == step
    assert "rollout/staleness_mean" not in metrics     # one name for one quantity


def test_saved_rollouts_report_the_batch_they_replayed(tmp_path):
    saved = [sample(i, i / 4, i + 1, [0] * (i + 1)) for i in range(4)]
    RolloutDumper(tmp_path).write(0, saved)
    source = SavedRollouts(tmp_path)
    batch = asyncio.run(source.get_batch(4, current_version=2))
    assert source.metrics() == rollout_metrics(batch, 2) == batch_metrics(saved, 2)
