"""rollout-only dumps and train-only replay."""
from __future__ import annotations

import asyncio

import pytest
import torch

from rollout.dump import RolloutDumper, SavedRollouts, load_step
from sao_megatron.core.records import Sample, SampleStatus


def sample(i):
    return Sample(uid=f"p{i}", prompt_index=i, prompt_ids=[1, 2], response_ids=[5, 6, 2], loss_mask=[1, 1, 1],
                  rollout_logprobs=[-0.5, -0.25, -1.0], weight_versions=[i, i, i + 1], reward=i / 10,
                  status=SampleStatus.COMPLETED, routed_experts=torch.full((4, 2, 2), i, dtype=torch.int32),
                  label=str(i), metadata={"task": "arithmetic"})


def test_dump_round_trip_is_exact(tmp_path):
    samples = [sample(i) for i in range(3)]
    path = RolloutDumper(tmp_path).write(7, samples)
    assert path.name == "step_000007.jsonl" and not list(tmp_path.glob("*.tmp"))
    back = load_step(path)
    for a, b in zip(samples, back):
        assert b.to_dict() == a.to_dict() and torch.equal(a.routed_experts, b.routed_experts)


def test_train_only_replays_in_order_across_batch_sizes_and_resumes(tmp_path):
    dumper = RolloutDumper(tmp_path)
    dumper.write(0, [sample(i) for i in range(4)])
    dumper.write(1, [sample(i) for i in range(4, 8)])
    src = SavedRollouts(tmp_path)

    async def take(s, n):
        return [x.uid for x in await s.get_batch(n, 0)]

    assert asyncio.run(take(src, 3)) == ["p0", "p1", "p2"]
    state = src.state_dict()
    assert asyncio.run(take(src, 3)) == ["p3", "p4", "p5"]
    again = SavedRollouts(tmp_path)
    again.load_state_dict(state)
    assert asyncio.run(take(again, 3)) == ["p3", "p4", "p5"]
    with pytest.raises(EOFError, match="exhausted"):
        asyncio.run(take(again, 3))


def test_missing_or_corrupt_dump_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no step_"):
        SavedRollouts(tmp_path)
    (tmp_path / "step_000000.jsonl").write_text('{"uid": "p0"}\n')
    with pytest.raises(ValueError, match="step_000000.jsonl:1"):
        load_step(tmp_path / "step_000000.jsonl")
