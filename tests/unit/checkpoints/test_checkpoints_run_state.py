"""Run checkpoints: lossless resume of a fake prompt/sample stream, atomicity, keep_last, corruption."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from checkpoints.manifest import CheckpointCorruptError
from checkpoints.run_state import RngState, RunCheckpointer, ValueState
from sao_megatron.core.records import Sample, SampleStatus


class FakeDriver:
    """A prompt cursor, a buffer of finished samples and in-flight (partial) samples, like the rollout
    driver's state. Each step: prompts start generating, partial samples grow a token, those reaching
    3 tokens finish into the buffer; the trainer takes up to 2 finished samples."""

    def __init__(self):
        self.cursor, self.buffer, self.in_flight = 0, [], []

    def step(self) -> list[Sample]:
        for s in self.in_flight:
            s.response_ids.append(int(torch.randint(0, 100, ()).item()))   # needs the torch RNG
            s.rollout_logprobs.append(-random.random())                     # needs the python RNG
            s.loss_mask.append(1)
            s.weight_versions.append(len(s.response_ids))
        done = [s for s in self.in_flight if len(s.response_ids) >= 3]
        self.in_flight = [s for s in self.in_flight if len(s.response_ids) < 3]
        for s in done:
            s.status = SampleStatus.COMPLETED
            s.routed_experts = torch.randint(0, 8, (len(s.prompt_ids) + 2, 2, 2), dtype=torch.int32)
        self.buffer += done
        for _ in range(int(np.random.randint(1, 3))):                      # needs the numpy RNG
            self.in_flight.append(Sample(uid=f"p{self.cursor}", prompt_index=self.cursor, prompt_ids=[1, 2, self.cursor]))
            self.cursor += 1
        batch, self.buffer = self.buffer[:2], self.buffer[2:]
        return batch

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "buffer": [s.to_dict() for s in self.buffer],
                "in_flight": [s.to_dict() for s in self.in_flight]}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = state["cursor"]
        self.buffer = [Sample.from_dict(d) for d in state["buffer"]]
        self.in_flight = [Sample.from_dict(d) for d in state["in_flight"]]


def _run(root, steps: int, stop_at: int | None = None, resume: bool = False):
    """Train `steps` steps (a fake model + optimizer on sample-dependent data); optionally stop early
    after checkpointing at `stop_at`, or resume from the latest checkpoint first."""
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    driver, trainer = FakeDriver(), {"step": 0, "version": 0, "run_id": "abc123"}
    parts = {"policy": model, "optimizer": opt, "driver": driver, "rng": RngState(),
             "trainer": ValueState(lambda: trainer, trainer.update)}
    ckpt = RunCheckpointer(root, keep_last=2)
    if resume:
        assert ckpt.load(parts) is not None
    seen, losses = [], []
    while trainer["step"] < steps:
        batch = driver.step()
        seen += [(s.uid, tuple(s.response_ids), tuple(s.rollout_logprobs)) for s in batch]
        x = torch.tensor([[s.prompt_index, *s.response_ids] for s in batch] or [[0.0] * 4], dtype=torch.float32)
        loss = model(x + torch.randn_like(x)).pow(2).mean()
        opt.zero_grad(), loss.backward(), opt.step()
        losses.append(loss.item())
        trainer["step"] += 1
        trainer["version"] += 1
        if trainer["step"] == stop_at:
            ckpt.save(trainer["step"], parts)
            return seen, losses, ckpt
    return seen, losses, ckpt


def test_resume_continues_the_exact_stream_and_losses(tmp_path):
    full_seen, full_losses, _ = _run(tmp_path / "a", steps=12)
    first_seen, first_losses, _ = _run(tmp_path / "b", steps=12, stop_at=5)
    rest_seen, rest_losses, _ = _run(tmp_path / "b", steps=12, resume=True)
    assert first_seen + rest_seen == full_seen           # no sample lost, duplicated or altered
    uids = [u for u, *_ in full_seen]
    assert len(uids) == len(set(uids)) and len(uids) >= 10
    assert first_losses + rest_losses == full_losses     # bit-identical losses (model, optimizer, RNG restored)


def test_components_round_trip_values(tmp_path):
    trainer = {"step": 7, "version": 6, "run_id": "wandb-xyz"}
    RunCheckpointer(tmp_path).save(7, {"trainer": ValueState(lambda: trainer, trainer.update)})
    got = {}
    path = RunCheckpointer(tmp_path).load({"trainer": ValueState(lambda: got, got.update)})
    assert got == trainer and path.name == "step_00000007"


def _save_steps(root, steps, keep_last=2):
    ckpt = RunCheckpointer(root, keep_last=keep_last)
    for s in steps:
        ckpt.save(s, {"trainer": ValueState(lambda s=s: {"step": s}, lambda st: None)})
    return ckpt


def test_keep_last_latest_pointer_and_manifest(tmp_path):
    ckpt = _save_steps(tmp_path, [1, 2, 3, 4], keep_last=2)
    assert [p.name for p in ckpt.list()] == ["step_00000003", "step_00000004"]
    assert (tmp_path / "latest").read_text() == "step_00000004"
    top = json.loads((tmp_path / "step_00000004" / "manifest.json").read_text())
    assert top["world_size"] == 1 and top["components"] == ["trainer"]
    rank = json.loads((tmp_path / "step_00000004" / "manifest.rank00000.json").read_text())
    assert len(rank["files"]["trainer.rank00000.pt"]["sha256"]) == 64
    assert not list(tmp_path.glob(".tmp-*"))


def test_interrupted_save_leaves_previous_checkpoint_loadable(tmp_path):
    ckpt = _save_steps(tmp_path, [1])

    class Exploding:
        def state_dict(self):
            raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError, match="killed mid-save"):
        ckpt.save(2, {"trainer": Exploding()})
    assert ckpt.latest().name == "step_00000001" and [p.name for p in ckpt.list()] == ["step_00000001"]
    got = {}
    assert ckpt.load({"trainer": ValueState(lambda: got, got.update)}).name == "step_00000001" and got == {"step": 1}


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_corrupted_checkpoint_refused_naming_file_and_previous(tmp_path, damage):
    ckpt = _save_steps(tmp_path, [1, 2])
    bad = tmp_path / "step_00000002"
    target = bad / ("manifest.json" if damage == "manifest" else "trainer.rank00000.pt")
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "delete":
        target.unlink()
    else:
        target.write_text("{not json")
    with pytest.raises(CheckpointCorruptError) as err:
        ckpt.load({"trainer": ValueState(dict, lambda s: None)})
    msg = str(err.value)
    assert "\n" not in msg and target.name in msg and "checkpoint.resume=" + str(tmp_path / "step_00000001") in msg


class _PerRankModel:
    """Model state saved one file per rank (checkpoint.format = per_rank)."""

    def __init__(self):
        self.loaded = None

    def state_dict_for_checkpoint(self):
        return {"w": torch.ones(2)}

    def load_checkpoint(self, state):
        self.loaded = state


class _ShardedModel:
    """Model state in a shared directory written by every rank (checkpoint.format = distributed)."""
    distributed_checkpoint = True

    def __init__(self, rank=0):
        self.rank, self.loaded_from = rank, None

    def save_distributed(self, path):
        (path / f"shard{self.rank}.bin").write_bytes(bytes([self.rank]) * 16)
        (path / "metadata").write_text("layout-independent")

    def load_distributed(self, path):
        self.loaded_from = sorted(p.name for p in path.iterdir())


def test_missing_component_and_world_size_mismatch(tmp_path):
    _save_steps(tmp_path, [1])
    with pytest.raises(CheckpointCorruptError, match=r"no state for component\(s\) \['critic'\]"):
        RunCheckpointer(tmp_path).load({"critic": ValueState(dict, lambda s: None)})
    RunCheckpointer(tmp_path / "m").save(1, {"policy": _PerRankModel()})
    with pytest.raises(CheckpointCorruptError, match=r"holds \['policy'\] per rank, saved by 1 ranks, and this run has 2"):
        RunCheckpointer(tmp_path / "m", rank=1, world_size=2).load({"policy": _PerRankModel()})


def test_distributed_components_resume_under_another_world_size(tmp_path):
    RunCheckpointer(tmp_path).save(3, {"policy": _ShardedModel(), "trainer": ValueState(lambda: {"step": 3}, None)})
    top = json.loads((tmp_path / "step_00000003" / "manifest.json").read_text())
    assert top["distributed"] == ["policy"] and set(top["distributed_files"]) == {"policy/shard0.bin", "policy/metadata"}
    got, model = {}, _ShardedModel(rank=1)
    RunCheckpointer(tmp_path, rank=1, world_size=2).load({"policy": model, "trainer": ValueState(dict, got.update)})
    assert model.loaded_from == ["metadata", "shard0.bin"] and got == {"step": 3}   # rank 1 reads rank 0's small state
    with pytest.raises(CheckpointCorruptError, match="checkpoint.format = distributed"):
        RunCheckpointer(tmp_path).load({"policy": _PerRankModel()})
    (tmp_path / "step_00000003" / "policy" / "shard0.bin").write_bytes(b"x" * 16)
    with pytest.raises(CheckpointCorruptError, match=r"shard0.bin is corrupted"):
        RunCheckpointer(tmp_path).load({"policy": _ShardedModel()})


def test_nothing_to_resume_returns_none(tmp_path):
    assert RunCheckpointer(tmp_path / "empty").load({"trainer": ValueState(dict, lambda s: None)}) is None
