"""The trainer's collaborators (sao_megatron/trainer/components.py): every sample source speaks the one
SampleSource interface, the debug modes are decided once in build_components, and the trainer's
state is its own record that a checkpoint saves and loads."""
from __future__ import annotations

import asyncio

import pytest

from rollout.driver import RolloutDriver
from rollout.dump import DumpingSource, SavedRollouts
from rollout.sample_source import SampleSource
from sao_megatron.core.records import Sample, SampleStatus
from sao_megatron.trainer.state import TrainerState, total_steps


def _sample(i: int) -> Sample:
    return Sample(uid=f"s{i}", prompt_index=i, prompt_ids=[1, 2], response_ids=[3], loss_mask=[1],
                  rollout_logprobs=[-0.5], weight_versions=[0], reward=float(i), status=SampleStatus.COMPLETED)


class CountingSource:
    """A SampleSource handing out s0, s1, ... and recording start/stop."""

    def __init__(self):
        self.next, self.calls = 0, []

    async def start(self):
        self.calls.append("start")

    async def stop(self):
        self.calls.append("stop")

    async def get_batch(self, num_samples, current_version):
        batch = [_sample(self.next + i) for i in range(num_samples)]
        self.next += num_samples
        return batch

    def metrics(self):
        return {"rollout/next": self.next}

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


@pytest.mark.parametrize("cls", [RolloutDriver, SavedRollouts, DumpingSource, CountingSource])
def test_every_sample_source_has_the_interface(cls):
    assert issubclass(cls, SampleSource)


def test_rollout_only_dump_replays_in_train_only(tmp_path):
    """DumpingSource saves each batch as the next step file; SavedRollouts hands the same samples back."""
    inner = CountingSource()
    dumping = DumpingSource(inner, tmp_path)

    async def collect():
        await dumping.start()
        batches = [await dumping.get_batch(3, 0) for _ in range(2)]
        await dumping.stop()
        return batches

    batches = asyncio.run(collect())
    assert inner.calls == ["start", "stop"] and dumping.metrics() == {"rollout/next": 6}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000.jsonl", "step_000001.jsonl"]
    saved = SavedRollouts(tmp_path)
    again = asyncio.run(saved.get_batch(6, 0))
    assert [s.to_dict() for s in again] == [s.to_dict() for b in batches for s in b]


def test_trainer_state_round_trips_through_a_checkpoint(tmp_path):
    from checkpoints.run_state import RunCheckpointer

    RunCheckpointer(tmp_path).save(7, {"trainer": TrainerState(step=7, version=4, baseline=0.25)})
    loaded = TrainerState()
    RunCheckpointer(tmp_path).load({"trainer": loaded})
    assert loaded == TrainerState(step=7, version=4, baseline=0.25)


def _build(tiny_model_dir, tmp_path, monkeypatch, debug: str, extra=()):
    """build_components for `debug` with the engines and driver replaced by a CountingSource."""
    from sao_megatron.core.config import load_recipe
    from sao_megatron.trainer import components as components_mod

    source = CountingSource()

    async def fake_rollout(recipe, tokenizer, stack):
        return ["engine"], source, None

    monkeypatch.setattr(components_mod, "_build_rollout", fake_rollout)
    recipe = load_recipe(None, [f"model.path='{tiny_model_dir}'", f"run.output_dir='{tmp_path}'",
                                f"run.debug='{debug}'", "logging.wandb=false", "logging.plot=false",
                                "logging.console=false", "checkpoint.save_on_signal=false", *extra])
    recipe.run_dir.mkdir(parents=True, exist_ok=True)

    # the device mode is thread-local: an earlier test may have installed the shim from another thread
    from parallel.cpu_shim import enter_shim_in_this_thread

    enter_shim_in_this_thread()

    async def build():
        async with components_mod.build_components(recipe, 0, 1) as parts:
            return parts

    return recipe, asyncio.run(build()), source


def test_debug_modes_are_decided_once(tiny_model_dir, tmp_path, monkeypatch):
    from sao_megatron.trainer.weight_updates import NoWeightUpdates, WeightUpdates

    recipe, parts, source = _build(tiny_model_dir, tmp_path / "collect", monkeypatch, "rollout-only")
    assert isinstance(parts.samples, DumpingSource) and parts.samples.source is source
    assert parts.critic is None and not parts.trains and isinstance(parts.weights, NoWeightUpdates)
    assert not parts.checkpoints.saves and source.calls == ["stop"]   # stopped on the way out
    assert asyncio.run(parts.weights.sync(1)) == {}
    assert total_steps(recipe) == recipe.critic.warmup_steps + recipe.run.num_steps

    DumpingSource(CountingSource(), tmp_path / "saved").dumper.write(0, [_sample(0)])
    _, parts, _ = _build(tiny_model_dir, tmp_path / "replay", monkeypatch, "train-only",
                         [f"run.debug_dir='{tmp_path / 'saved'}'"])
    assert isinstance(parts.samples, SavedRollouts) and parts.engines == []
    assert parts.critic is not None and parts.trains and isinstance(parts.weights, NoWeightUpdates)

    _, parts, driver = _build(tiny_model_dir, tmp_path / "full", monkeypatch, "none")
    assert parts.samples is driver and parts.checkpoints.saves and isinstance(parts.weights, WeightUpdates)
    assert parts.weights.driver is driver and parts.weights.weight_sync is not None
