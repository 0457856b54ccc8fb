"""`sao sft` (sao_megatron/trainer/sft.py): the loss on response tokens only, the loss falling on the
tiny model, an HF model that `sao train` loads, and a recipe that chains SFT then RL (SFT once)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sao_megatron.core.config import load_recipe
from sao_megatron.trainer.sft import _is_done, _marker, sft_batches, sft_loss_fn, sft_output_dir

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "tiny_sft_sao_cpu.toml"


def test_loss_covers_response_tokens_only():
    batches = sft_batches([([5, 6, 7], [8, 9]), ([5], [4, 3, 2])], token_budget=1024)
    assert len(batches) == 1
    batch = batches[0]
    assert batch.loss_mask.sum() == 5 and batch.global_num_tokens == 5
    rows = {tuple(batch.tokens[r, :int(batch.lengths[r])].tolist()): r for r in range(2)}
    assert batch.loss_mask[rows[(5, 6, 7, 8, 9)]].tolist() == [0, 0, 0, 1, 1]
    assert batch.loss_mask[rows[(5, 4, 3, 2)]].tolist()[:4] == [0, 1, 1, 1]
    logp = torch.full(batch.tokens.shape, -2.0)
    logp[batch.loss_mask == 0] = -100.0            # prompt and padding must not count
    out = sft_loss_fn(batch, {"logp": logp})
    assert abs(float(out.loss) - 2.0) < 1e-6       # mean CE over the 5 response tokens


def test_marker_tracks_the_sft_section(tmp_path):
    recipe = load_recipe(RECIPE, [f"run.output_dir='{tmp_path}'", "sft.steps=5"], check_files=False)
    out = sft_output_dir(recipe)
    assert out == tmp_path / "tiny-sft-sao" / "sft_model"
    assert not _is_done(recipe, out)
    out.mkdir(parents=True)
    (out / "sao_sft.json").write_text(json.dumps(_marker(recipe)))
    assert _is_done(recipe, out)
    changed = load_recipe(RECIPE, [f"run.output_dir='{tmp_path}'", "sft.steps=6"], check_files=False)
    assert not _is_done(changed, out)              # another [sft] section: SFT runs again


def test_an_interrupted_export_leaves_no_done_marker(tmp_path, monkeypatch):
    import checkpoints.hf_io as hf_io
    from sao_megatron.trainer.sft import _export

    recipe = load_recipe(RECIPE, [f"run.output_dir='{tmp_path}'", "sft.steps=5"], check_files=False)
    out = sft_output_dir(recipe)
    out.mkdir(parents=True)
    (out / "sao_sft.json").write_text(json.dumps(_marker(recipe)))   # an earlier export of the same section
    (out / "model.safetensors").write_bytes(b"old")

    def interrupted(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_io, "save_hf_checkpoint", interrupted)
    with pytest.raises(OSError, match="disk full"):
        _export(recipe, type("Policy", (), {"export_hf": lambda self: iter(())})(), rank=0)
    assert not _is_done(recipe, out)               # `sao train` must run SFT again, not load a partial model


def _sao(tmp: Path, command: str, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", command, str(RECIPE), f"run.output_dir='{tmp}'",
           "run.name='sft'", f"model.path='{tmp / 'model'}'", "logging.wandb=false", "rollout.task='chain:1:1'",
           "sft.batch_size=16", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _weights(model_dir: Path) -> dict:
    from checkpoints.hf_io import HFCheckpoint

    return dict(HFCheckpoint(model_dir))


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    proc = _sao(tmp, "sft", "sft.steps=40", "sft.lr=2e-3")
    return tmp, proc


def test_sft_loss_falls_and_writes_a_model(sft_run):
    tmp, proc = sft_run
    rows = _rows(tmp / "sft" / "sft" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 41))
    losses = [r["train/sft_loss"] for r in rows]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert all(r["perf/step_time_s"] > 0 for r in rows)
    out = tmp / "sft" / "sft_model"
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    base, tuned = _weights(tmp / "model"), _weights(out)
    assert base.keys() == tuned.keys()
    assert any(not torch.equal(base[k], tuned[k]) for k in base)
    assert f"model.path={out}" in proc.stdout


def test_train_chains_sft_then_rl_and_runs_sft_once(sft_run):
    tmp, _ = sft_run
    overrides = ("sft.steps=40", "sft.lr=2e-3", "run.num_steps=1", "critic.warmup_steps=1", "rollout.batch_size=8",
                 "rollout.max_in_flight=8")
    proc = _sao(tmp, "train", *overrides)
    out = tmp / "sft" / "sft_model"
    assert "already holds this recipe's SFT model" in proc.stderr, proc.stderr[-3000:]   # `sao sft`'s model reused
    resolved = load_recipe(tmp / "sft" / "resolved_recipe.toml", check_files=False)
    assert Path(resolved.model.path) == out                          # RL ranks load the SFT model
    rows = _rows(tmp / "sft" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2], proc.stderr[-3000:]
    # the SFT model learned to answer and stop (EOS); the random init runs to max_new_tokens (8)
    assert rows[0]["rollout/response_len"] < 4.0, rows
    assert "rollout/accuracy" in rows[0] and "critic/value0_return_corr" in rows[0]


@pytest.mark.parametrize("overrides,field", [(["sft.task='countdown'"], "sft.task"),
                                             (["sft.task='chain:9:9'"], "sft.task"),
                                             (["sft.dataset='/nonexistent/pairs.jsonl'"], "sft.dataset")])
def test_unusable_sft_data_is_a_recipe_error(tmp_path, overrides, field):
    from sao_megatron.core.config import ConfigError
    from sao_megatron.trainer.sft import check_sft_data

    recipe = load_recipe(RECIPE, [f"run.output_dir='{tmp_path}'", *overrides], check_files=False)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        check_sft_data(recipe)
    assert not (tmp_path / "tiny-sft-sao").exists()             # refused before the run directory


def test_jsonl_pairs_feed_sft(tmp_path, tiny_model_dir):
    """A dataset row's `response` is the target; the prompt goes through the chat template."""
    from transformers import AutoTokenizer

    from sao_megatron.trainer.sft import _sft_source, next_pair

    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "2+2=", "response": "4"}) + "\n")
    recipe = load_recipe(RECIPE, [f"model.path='{tiny_model_dir}'", f"sft.dataset='{data}'"], check_files=False)
    source, tokenizer = _sft_source(recipe)
    prompt_ids, response_ids = next_pair(source, tokenizer, recipe)
    assert tokenizer.decode(prompt_ids).endswith("2+2=<|im_end|>\n<|im_start|>assistant\n")
    assert response_ids == tokenizer.encode("4", add_special_tokens=False) + [tokenizer.eos_token_id]


def test_demo_recipe_chains_sft_then_sao():
    recipe = load_recipe(RECIPE, check_files=False)
    assert recipe.sft.steps > 0 and recipe.algorithm.name == "sao" and recipe.rollout.task.startswith("chain:")
