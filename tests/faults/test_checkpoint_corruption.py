"""Corrupted checkpoints are found before any model is built (issue 15.4): a truncated shard, a flipped
byte, a missing or unreadable manifest. checkpoint.resume = auto falls back to the newest checkpoint
that verifies and says which and why in one line; a named checkpoint that fails, or no good one at all,
is a one-line error with exit 2, and the trainer never reaches model building."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints.manifest import CheckpointCorruptError
from checkpoints.run_state import RunCheckpointer, ValueState
from sao_megatron.core.config import ConfigError, load_recipe
from sao_megatron.trainer.checkpointing import resolve_resume

REPO = Path(__file__).resolve().parents[2]
MODEL_CONFIG = ('{"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "num_hidden_layers": 4, '
                '"max_position_embeddings": 4096, "model_type": "qwen3_moe"}')


class _Shards:
    """A model saved as a shared distributed checkpoint directory (the big files of a real run)."""
    distributed_checkpoint = True

    def save_distributed(self, path: Path) -> None:
        (path / "shard0.bin").write_bytes(bytes(range(256)) * 8)

    def load_distributed(self, path: Path) -> None:
        self.loaded = path


def _parts(step: int) -> dict:
    weights = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(weights.weight, float(step))
    return {"policy": weights, "trainer": ValueState(lambda: {"step": step}, lambda s: None), "critic": _Shards()}


def _save(root: Path, steps=(10, 20, 30)) -> RunCheckpointer:
    ckpt = RunCheckpointer(root, keep_last=5, rank=0, world_size=1)
    for step in steps:
        ckpt.save(step, _parts(step))
    return ckpt


def _damage(step_dir: Path, how: str) -> Path:
    """Break one file of a checkpoint; returns the file broken."""
    targets = {"truncate": "policy.rank00000.pt", "flip": "policy.rank00000.pt", "flip_shard": "critic/shard0.bin",
               "truncate_shard": "critic/shard0.bin", "delete": "trainer.rank00000.pt",
               "no_manifest": "manifest.json", "bad_manifest": "manifest.json", "rank_manifest": "manifest.rank00000.json",
               "manifest_list": "manifest.json"}
    target = step_dir / targets[how]
    data = target.read_bytes()
    if how.startswith("truncate"):
        target.write_bytes(data[: len(data) // 2])
    elif how.startswith("flip"):
        middle = len(data) // 2
        target.write_bytes(data[:middle] + bytes([data[middle] ^ 0x10]) + data[middle + 1:])
    elif how in ("delete", "no_manifest"):
        target.unlink()
    elif how == "manifest_list":
        target.write_text("[1, 2]")
    else:
        target.write_text("{not json")
    return target


DAMAGES = ["truncate", "flip", "flip_shard", "truncate_shard", "delete", "no_manifest", "bad_manifest",
           "rank_manifest", "manifest_list"]


@pytest.mark.parametrize("how", DAMAGES)
def test_auto_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path, how):
    ckpt = _save(tmp_path)
    target = _damage(tmp_path / "step_00000030", how)
    chosen, skipped = ckpt.choose("auto")
    assert chosen == tmp_path / "step_00000020"
    assert len(skipped) == 1 and skipped[0].startswith("step_00000030") and target.name in skipped[0]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_named_corrupted_checkpoint_is_refused_naming_the_file(tmp_path, how):
    ckpt = _save(tmp_path)
    target = _damage(tmp_path / "step_00000030", how)
    with pytest.raises(CheckpointCorruptError) as err:
        ckpt.choose(str(tmp_path / "step_00000030"))
    assert "\n" not in str(err.value) and target.name in str(err.value)


def test_two_newest_corrupted_falls_back_two_and_names_both(tmp_path):
    ckpt = _save(tmp_path)
    _damage(tmp_path / "step_00000030", "flip")
    _damage(tmp_path / "step_00000020", "truncate_shard")
    chosen, skipped = ckpt.choose("auto")
    assert chosen == tmp_path / "step_00000010"
    assert [s.split(" ")[0] for s in skipped] == ["step_00000030", "step_00000020"]


def test_the_fallback_loads_the_older_state(tmp_path):
    ckpt = _save(tmp_path)
    _damage(tmp_path / "step_00000030", "flip")
    chosen, _ = ckpt.choose("auto")
    model = torch.nn.Linear(3, 2)
    ckpt.load({"policy": model, "trainer": ValueState(dict, lambda s: None), "critic": _Shards()}, path=chosen)
    assert torch.all(model.weight == 20.0)


def test_nothing_saved_resumes_nothing_and_never_means_never(tmp_path):
    assert RunCheckpointer(tmp_path / "none", rank=0, world_size=1).choose("auto") == (None, [])
    _save(tmp_path)
    assert RunCheckpointer(tmp_path, rank=0, world_size=1).choose("never") == (None, [])


def _recipe(tmp_path: Path, resume: str = "auto"):
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(MODEL_CONFIG)
    path = tmp_path / "recipe.toml"
    path.write_text(f'[run]\nname = "r"\noutput_dir = "{tmp_path / "runs"}"\n[model]\npath = "{tmp_path / "model"}"\n'
                    f'[rollout]\ntask = "arithmetic"\n[checkpoint]\nresume = "{resume}"\n')
    return path


def test_resolve_resume_says_which_and_why_in_one_line(tmp_path, capsys):
    recipe = load_recipe(_recipe(tmp_path))
    _save(recipe.run_dir / "checkpoints")
    target = _damage(recipe.run_dir / "checkpoints" / "step_00000030", "truncate")
    resolved = resolve_resume(recipe, rank=0, world_size=1)
    assert resolved.checkpoint.resume == str(recipe.run_dir / "checkpoints" / "step_00000020")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step_00000030" in err and target.name in err and "step_00000020" in err


def test_resolve_resume_with_no_good_checkpoint_is_a_config_error(tmp_path):
    recipe = load_recipe(_recipe(tmp_path))
    _save(recipe.run_dir / "checkpoints", steps=(10,))
    _damage(recipe.run_dir / "checkpoints" / "step_00000010", "flip")
    with pytest.raises(ConfigError) as err:
        resolve_resume(recipe, rank=0, world_size=1)
    assert err.value.field == "checkpoint.resume" and "\n" not in str(err.value) and "never" in err.value.fix


def test_a_named_checkpoint_without_a_manifest_is_refused_when_the_recipe_loads(tmp_path):
    (tmp_path / "step_00000005").mkdir()
    with pytest.raises(ConfigError, match="checkpoint.resume: .* has no manifest.json"):
        load_recipe(_recipe(tmp_path, resume=str(tmp_path / "step_00000005")))


_NO_MODELS = """
import sys
import sao_megatron.trainer.components as components
def refuse(*args, **kwargs):
    raise SystemExit("models were built")
components._build_models = refuse
from sao_megatron.cli.main import main
sys.exit(main(["train", sys.argv[1]]))
"""


@pytest.mark.parametrize("resume", ["auto", "named"])
def test_sao_train_refuses_a_corrupted_checkpoint_before_building_models(tmp_path, resume):
    named = tmp_path / "runs" / "r" / "checkpoints" / "step_00000010"
    path = _recipe(tmp_path, resume="auto" if resume == "auto" else str(named))
    _save(named.parent, steps=(10,))
    _damage(named, "flip_shard")
    done = subprocess.run([sys.executable, "-c", _NO_MODELS, str(path)], capture_output=True, text=True, cwd=REPO,
                          timeout=600)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "checkpoint.resume" in line]
    assert len(lines) == 1 and "shard0.bin" in lines[0] and "models were built" not in done.stderr
    assert "Traceback" not in done.stderr
    assert json.loads((named / "manifest.json").read_text())["step"] == 10   # nothing was rewritten


def _two_rank_fallback(root: str) -> dict:
    """Each rank checksums half the files: a flipped byte only rank 1 hashes still moves both ranks back."""
    import torch.distributed as dist

    rank = dist.get_rank()
    ckpt = RunCheckpointer(root, keep_last=3)
    for step in (1, 2):
        mine = {"rank": rank, "step": step}
        ckpt.save(step, {"shard": ValueState(lambda m=mine: m, lambda s: None)})
    dist.barrier()
    if rank == 0:   # rank 1 checksums this file (every second of the sorted list); rank 0 only sizes it
        files = sorted(json.loads((Path(root) / "step_00000002" / "manifest.rank00001.json").read_text())["files"])
        target = Path(root) / "step_00000002" / files[0]
        data = target.read_bytes()
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    dist.barrier()
    chosen, skipped = ckpt.choose("auto")
    return {"chosen": chosen.name, "skipped": skipped}


def test_all_ranks_fall_back_together(tmp_path):
    from parallel.distributed import run_distributed_test

    results = run_distributed_test(_two_rank_fallback, world_size=2, timeout_s=300, args=(str(tmp_path),))
    assert [r["chosen"] for r in results] == ["step_00000001", "step_00000001"]
    assert all(len(r["skipped"]) == 1 and r["skipped"][0].startswith("step_00000002") for r in results)
    assert any("shard.rank00001.pt" in r["skipped"][0] for r in results)
    assert any("rank(s) [" in r["skipped"][0] for r in results)   # the rank that hashed it fine learns why
