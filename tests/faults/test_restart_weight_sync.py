"""A locally started engine that dies and is restarted takes the next weight push from every sender.

Two gloo ranks play two pipeline stages with per-stage senders (weight_sync.senders = per_stage,
parallel.pp = 2): each rank's sender broadcasts its stage's half of the tiny model's tensors to one
reference server, started by rank 0 with rollout.engine_restarts = 1. After a first push the server
is SIGKILLed; EngineRestarts (rank 0 only) starts it again; the second push must land from BOTH
stages, checked tensor by tensor with the weight checker (weight_sync.check_equal). The bug this
guards: only rank 0's sender formed its group again, so stage 1 broadcast into a group whose engine
process was gone and the push after every restart failed.
"""
from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from parallel.distributed import DistributedTestError, run_distributed_test

SCALES = {1: 2.0, 2: 3.0}     # version -> factor on every float tensor: each push differs from the disk weights


class StagePolicy:
    """The policy's export: this stage's half of the model's tensors (scope 'stage'), or all of them."""

    def __init__(self, model_dir: str, stage: int):
        from safetensors.torch import load_file

        self.hf = {}
        for shard in sorted(Path(model_dir).glob("*.safetensors")):
            self.hf.update(load_file(shard))
        names = sorted(self.hf)
        self.mine = set(names[: len(names) // 2] if stage == 0 else names[len(names) // 2:])
        self.scale = 1.0

    def export_hf(self, scope: str = "all", snapshot: bool = True):
        for name in sorted(self.hf):
            if scope == "all" or name in self.mine:
                tensor = self.hf[name]
                yield name, tensor * self.scale if tensor.is_floating_point() else tensor


class NoDriver:
    """EngineRestarts tells the rollout driver about a restart; no driver runs here."""

    def engine_restarting(self, name):
        pass

    def engine_restarted(self, name, ok):
        pass


def _recipe(model_dir: str, out_dir: str):
    from sao_megatron.core.config import load_recipe

    return load_recipe(None, [f"model.path='{model_dir}'", f"run.output_dir='{out_dir}'", "run.name='restart_sync'",
                              "rollout.engine_restarts=1", "parallel.pp=2", "weight_sync.senders='per_stage'",
                              "weight_sync.check_equal=true", "weight_sync.timeout_s=60"], check_files=False)


def _rank(model_dir: str, out_dir: str) -> dict:
    """Both ranks: push v1, (rank 0) kill the engine and wait for its restart, push v2 with check_equal."""
    import torch.distributed as dist

    import parallel.distributed as distributed

    rank = dist.get_rank()
    distributed.pipeline_stage_group = lambda: (rank, None, 0)   # stage = rank, each the first of its stage
    recipe = _recipe(model_dir, out_dir)
    if rank == 0:
        recipe.run_dir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_scenario(recipe, StagePolicy(model_dir, rank), rank))


async def _scenario(recipe, policy: StagePolicy, rank: int) -> dict:
    from sao_megatron.trainer.engine_restarts import EngineRestarts
    from sao_megatron.trainer.engines import start_engines
    from sao_megatron.trainer.weight_updates import build_weight_updates

    engines, restarts, out = [], None, {}
    if rank == 0:
        engines, handles = await start_engines(recipe, recipe.run_dir)
        restarts = EngineRestarts(recipe, engines, handles, NoDriver(), recipe.run_dir)
        restarts.start()
    weights = build_weight_updates(recipe, policy, engines, None, rank, 2, restarts)
    try:
        policy.scale = SCALES[1]
        await weights.after_resume(1)                # both stages push; check_equal compares every tensor
        if rank == 0:
            old_pid = handles[0].process.pid
            os.kill(old_pid, signal.SIGKILL)
            while not (restarts.restarts and restarts.settled.is_set()):
                await asyncio.sleep(0.2)
            out["pids"] = (old_pid, restarts.slots[engines[0].name][1].process.pid)
        policy.scale = SCALES[2]
        await weights.after_resume(2)                # the restarted process: both stages' groups formed anew
        out["regrouped"] = weights.restarts_seen
        if rank == 0:
            from rollout.weights import check_weight_update_equal

            checks = await check_weight_update_equal(engines, policy.export_hf())
            out["checked"] = [(c.engine, c.compared) for c in checks]
            out["version"] = await engines[0].weight_version()
        return out
    finally:
        if restarts is not None:
            await restarts.stop()
        for engine in engines if rank == 0 else weights.engines:
            await engine.close()


def test_after_an_engine_restart_every_stage_sender_regroups_and_the_push_lands(tiny_model_dir, tmp_path):
    try:
        outcomes = run_distributed_test(_rank, world_size=2, timeout_s=600, args=(str(tiny_model_dir), str(tmp_path)))
    except DistributedTestError as err:
        pytest.fail(f"the push after the restart failed or hung: {str(err).strip().splitlines()[-1]}")
    first, second = outcomes
    old_pid, new_pid = first["pids"]
    assert new_pid != old_pid
    assert first["regrouped"] == second["regrouped"] == 1        # every rank saw the restart, not only rank 0
    assert len(first["checked"]) == 1 and first["checked"][0][1] > 0 and first["version"] == 2
