"""SampleBuffer: whole groups, filters, failed groups, staleness eviction, token budgets, state."""
from __future__ import annotations

import pytest

from rollout.buffer import SampleBuffer, nonzero_reward_variance
from sao_megatron.core.records import Sample, SampleStatus


def s(uid, gid, reward=1.0, versions=(0,), status=SampleStatus.COMPLETED, ntok=1):
    return Sample(uid=uid, prompt_index=gid, prompt_ids=[1] * ntok, response_ids=[5] * len(versions),
                  loss_mask=[1] * len(versions), rollout_logprobs=[0.0] * len(versions),
                  weight_versions=list(versions), reward=reward, status=status, group_id=gid)


def test_groups_are_released_whole_and_in_order():
    b = SampleBuffer(group_size=2, capacity=10)
    assert b.put(s("p0-1", 0)) is None and b.num_ready == 0 and b.num_partial == 1
    b.put(s("p1-0", 1))
    assert [x.uid for x in b.put(s("p1-1", 1))] == ["p1-0", "p1-1"]
    b.put(s("p0-0", 0))
    assert [x.uid for x in b.pop(4)] == ["p1-0", "p1-1", "p0-0", "p0-1"]
    with pytest.raises(ValueError, match="multiple of the group size"):
        b.pop(3)


def test_failed_member_drops_group_and_filter_drops_zero_variance():
    b = SampleBuffer(group_size=2, capacity=10, filters=[nonzero_reward_variance])
    b.put(s("p0-0", 0)), b.put(s("p0-1", 0, status=SampleStatus.FAILED, reward=None))
    b.put(s("p1-0", 1, reward=1.0)), b.put(s("p1-1", 1, reward=1.0))
    b.put(s("p2-0", 2, reward=1.0)), b.put(s("p2-1", 2, reward=0.0))
    assert b.dropped_failed == 2 and b.dropped_filtered == 2 and b.num_ready == 2


def test_duplicate_put_is_refused():
    b = SampleBuffer()
    b.put(s("p0", 0))
    b2 = SampleBuffer(group_size=2)
    b2.put(s("p0-0", 0))
    with pytest.raises(ValueError, match="twice"):
        b2.put(s("p0-0", 0))


def test_take_stale_uses_the_oldest_token_of_the_group():
    b = SampleBuffer(group_size=2, capacity=10)
    b.put(s("p0-0", 0, versions=(3, 3))), b.put(s("p0-1", 0, versions=(1, 3)))
    b.put(s("p1-0", 1, versions=(2,))), b.put(s("p1-1", 1, versions=(3,)))
    stale = b.take_stale(current_version=4, bound=2)
    assert [[x.uid for x in g] for g in stale] == [["p0-0", "p0-1"]] and b.num_ready == 2


def test_pop_by_token_budget_keeps_at_least_one_group():
    b = SampleBuffer(capacity=10)
    for i, n in enumerate([3, 3, 3]):
        b.put(s(f"p{i}", i, ntok=n))            # 4 tokens each
    assert len(b.pop(max_tokens=9)) == 2
    b.put(s("p9", 9, ntok=50))
    assert [x.uid for x in b.pop(max_tokens=5)] == ["p2"]
    assert [x.uid for x in b.pop(max_tokens=5)] == ["p9"]


def test_state_round_trip_and_room():
    b = SampleBuffer(group_size=2, capacity=6)
    b.put(s("p0-0", 0)), b.put(s("p0-1", 0)), b.put(s("p1-0", 1, versions=(2, 3)))
    assert b.room() == 3
    c = SampleBuffer(group_size=2, capacity=6)
    c.load_state_dict(b.state_dict())
    assert c.num_ready == 2 and c.num_partial == 1
    assert [x.uid for x in c.put(s("p1-1", 1))] == ["p1-0", "p1-1"]
    assert c.pop(4)[2].weight_versions == [2, 3]
