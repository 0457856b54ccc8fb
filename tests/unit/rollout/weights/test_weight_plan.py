"""The weight-update plan (rollout/weights/plan.py): every trainer rank's sender role, decided once, and the
factory that builds a transport for a role (rollout/weights/factory.py)."""
from __future__ import annotations

import dataclasses

import pytest

from rollout.weights.plan import SenderRole, plan_weight_update
from sao_megatron.core.config import WeightSyncConfig
from sao_megatron.core.dims import ParallelDims


def _kinds(plan) -> list[str]:
    return [r.kind for r in plan.roles]


def test_one_sender_gathers_everything_on_rank_zero():
    plan = plan_weight_update(ParallelDims(tp=2, dp=2), WeightSyncConfig(), engines=2, engine_tp=1)
    assert plan.turns == "one" and _kinds(plan) == ["rank0", "none", "none", "none"]
    assert {r.scope for r in plan.roles} == {"all"} and plan.senders == 1


def test_per_stage_senders_are_each_stages_first_rank():
    """tp 2 x pp 2 under Megatron's order tp-cp-ep-dp-pp: ranks 0-1 are stage 0, ranks 2-3 stage 1."""
    plan = plan_weight_update(ParallelDims(tp=2, pp=2), WeightSyncConfig(senders="per_stage"), 1, 1)
    assert plan.turns == "per_stage" and _kinds(plan) == ["rank0", "none", "stage", "none"]
    assert [r.stage for r in plan.roles] == [0, 0, 1, 1] and {r.scope for r in plan.roles} == {"stage"}


def test_the_driver_setting_and_disk_keep_one_sender_under_pipeline_parallelism():
    for cfg in (WeightSyncConfig(senders="driver"), WeightSyncConfig(method="disk", senders="per_stage")):
        plan = plan_weight_update(ParallelDims(pp=2), cfg, 1, 1)
        assert plan.turns == "one" and _kinds(plan) == ["rank0", "none"], cfg


def test_shard_writes_make_every_rank_a_holder_and_none_labels_the_version():
    plan = plan_weight_update(ParallelDims(tp=2, dp=2), WeightSyncConfig(method="shard_writes"), 2, 2)
    assert plan.turns == "shares" and set(_kinds(plan)) == {"share"} and plan.shares_endpoints
    assert [(r.holder, r.holders) for r in plan.roles] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert not any(r.labels_versions for r in plan.roles)


def test_a_single_rank_trainer_sends_alone_whatever_the_method():
    for method in ("broadcast", "shard_writes", "disk"):
        plan = plan_weight_update(ParallelDims(), WeightSyncConfig(method=method), 1, 2)
        assert _kinds(plan) == ["rank0"] and plan.roles[0].labels_versions and not plan.shares_endpoints


def test_only_the_broadcast_export_yields_views_of_the_live_parameters():
    """The broadcast sender sends or copies every tensor before its push returns; disk and shard writes
    keep tensors past their turn, so their export copies (a snapshot)."""
    for method, snapshot in (("broadcast", False), ("shard_writes", True), ("disk", True)):
        for dims in (ParallelDims(), ParallelDims(tp=2, pp=2)):
            plan = plan_weight_update(dims, WeightSyncConfig(method=method), 1, 2)
            assert {r.snapshot for r in plan.roles} == {snapshot}


def test_a_role_is_frozen():
    role = plan_weight_update(ParallelDims(), WeightSyncConfig(), 1, 1).role(0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        role.labels_versions = False


def test_the_factory_builds_the_roles_transport():
    """A stage role's broadcast joins as that stage's group; a share role's shard writes leave the label to
    the driver; an FP8 layout with shard writes is refused by name."""
    from rollout.weights import build_weight_sync

    engines = [type("E", (), {"name": "e0", "url": "http://127.0.0.1:1"})()]
    stage = SenderRole(rank=2, kind="stage", scope="stage", stage=1)
    sync = build_weight_sync(WeightSyncConfig(backend="gloo"), engines, role=stage, ranks_per_engine=2)
    assert sync.stage == 1 and sync.engine_ranks == [2]
    share = SenderRole(rank=1, kind="share", scope="shares", holder=1, holders=2, labels_versions=False)
    shards = build_weight_sync(WeightSyncConfig(method="shard_writes", backend="gloo"), engines, role=share,
                               ranks_per_engine=2)
    assert shards.labels_versions is False
    with pytest.raises(ValueError, match="shard_writes.*FP8"):
        build_weight_sync(WeightSyncConfig(method="shard_writes"), engines, fp8=object())
