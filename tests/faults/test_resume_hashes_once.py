"""The resume hashes each checkpoint file once (issue 15: "checksums are computed twice on resume"):
resolve_resume verifies the chosen checkpoint whole before any model is built, and the load that
follows reuses that verification (same manifest: sizes only) instead of checksumming it again. A
checkpoint whose manifest is not the one verified is checksummed in full at load."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_checkpoint_corruption import _Shards, _damage, _recipe, _save

import checkpoints.manifest as manifest
from checkpoints.manifest import CheckpointCorruptError
from checkpoints.run_state import ValueState
from sao_megatron.core.config import load_recipe
from sao_megatron.trainer.checkpointing import Checkpoints, resolve_resume


@pytest.fixture
def hashed(monkeypatch) -> Counter:
    counts: Counter = Counter()
    real = manifest.sha256_file

    def counting(path, *args):
        counts[path.name] += 1
        return real(path, *args)

    monkeypatch.setattr(manifest, "sha256_file", counting)
    return counts


def _parts() -> dict:
    return {"policy": torch.nn.Linear(3, 2), "trainer": ValueState(dict, lambda s: None), "critic": _Shards()}


def test_resolve_then_resume_hashes_every_file_once(tmp_path, hashed):
    recipe = load_recipe(_recipe(tmp_path))
    _save(recipe.run_dir / "checkpoints", steps=(10, 20))
    hashed.clear()                         # the save hashed them to write the manifests
    verified: dict = {}
    recipe = resolve_resume(recipe, rank=0, world_size=1, verified=verified)
    assert verified["step"] == 20
    checkpoints = Checkpoints(recipe, 0, 1, saves=False)
    checkpoints.verified = verified
    parts = _parts()
    assert checkpoints.resume(parts).name == "step_00000020"
    assert torch.all(parts["policy"].weight == 20.0)
    files = ["manifest.rank00000.json", "policy.rank00000.pt", "trainer.rank00000.pt", "critic.rank00000.pt",
             "shard0.bin"]
    assert set(hashed) <= set(files) and hashed["policy.rank00000.pt"] == hashed["shard0.bin"] == 1
    assert max(hashed.values()) == 1, hashed


def test_without_that_verification_the_load_checksums_everything(tmp_path, hashed):
    recipe = load_recipe(_recipe(tmp_path))
    _save(recipe.run_dir / "checkpoints", steps=(10, 20))
    hashed.clear()
    checkpoints = Checkpoints(recipe, 0, 1, saves=False)   # resume = auto, nothing verified before
    assert checkpoints.resume(_parts()).name == "step_00000020"
    assert hashed["policy.rank00000.pt"] == hashed["shard0.bin"] == 1
    hashed.clear()
    checkpoints.verified = {"step": 20, "another": "manifest"}   # not the manifest there: no trust
    _damage(recipe.run_dir / "checkpoints" / "step_00000020", "flip")
    with pytest.raises(CheckpointCorruptError, match="policy.rank00000.pt is corrupted"):
        checkpoints.resume(_parts())
