"""CLI user errors that used to be tracebacks (issue 26.6): each is one line naming the input and the fix,
exit 2, found at the check (before a model is built or an engine started), and nothing is written."""
from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sao_megatron.cli.main import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_moe_cpu.toml"
GENEROUS_S = 120


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))}


def _corrupt(model: Path, how: str) -> None:
    shard = sorted(model.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    if how == "garbage":
        shard.write_bytes(os.urandom(100))
        return
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 10 ** 9      # a header that lies about where its tensor ends
    raw = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size:])


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    return model


# ------------------------------------------------------------------------------------------ sao convert
@pytest.mark.parametrize("direction", ["hf-to-mcore", "hf-to-fp8"])
@pytest.mark.parametrize("how", ["garbage", "lying_offsets"])
def test_convert_of_a_corrupt_or_lying_safetensors_is_one_line(model_copy, tmp_path, capsys, direction, how):
    _corrupt(model_copy, how)
    out = tmp_path / "out"
    assert main(["convert", direction, str(model_copy), str(out)]) == 2
    _one_line_error(capsys, str(model_copy), "safetensors", "fix")
    assert not out.exists()


def test_convert_of_a_model_whose_config_is_not_json_names_the_directory(model_copy, tmp_path, capsys):
    (model_copy / "config.json").write_text("{not json")
    assert main(["convert", "hf-to-mcore", str(model_copy), str(tmp_path / "out")]) == 2
    _one_line_error(capsys, str(model_copy), "does not parse", "fix")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out", [".", "sub", ".."])
def test_convert_refuses_an_output_overlapping_its_input(model_copy, capsys, out):
    before = _tree(model_copy.parent)
    assert main(["convert", "hf-to-mcore", str(model_copy), str(model_copy / out)]) == 2
    _one_line_error(capsys, "overlap", "fix")
    assert _tree(model_copy.parent) == before


# ------------------------------------------------------------------------------------------ sao sft
def _sft(tmp_path, dataset: Path, command: str = "sft") -> int:
    extra = ["sft.steps=2"]
    return main([command, str(TINY), f"run.output_dir='{tmp_path / 'runs'}'", "run.name='r'",
                 f"model.path='{tmp_path / 'model'}'", f"sft.dataset='{dataset}'", *extra])


@pytest.mark.parametrize("command", ["sft", "train"])
@pytest.mark.parametrize("content", [b"", os.urandom(2000), b"\n\n  \n", b'{"question": "1+1"}\n',
                                     b'{"prompt": "1+1"}\n'], ids=["empty", "binary", "blank", "no_prompt",
                                                                   "no_response"])
def test_sft_on_a_dataset_without_pairs_names_sft_dataset_and_creates_nothing(tmp_path, capsys, command, content):
    data = tmp_path / "pairs.jsonl"
    data.write_bytes(content)
    assert _sft(tmp_path, data, command) == 2
    err = _one_line_error(capsys, "sft.dataset", "fix")
    assert "rollout.dataset" not in err.split("fix:")[0]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "model").exists()


def test_sao_train_refusing_its_sft_task_creates_no_run_directory(tmp_path, capsys):
    assert main(["train", str(TINY), f"run.output_dir='{tmp_path / 'runs'}'", f"model.path='{tmp_path / 'model'}'",
                 "sft.steps=2", "sft.task='countdown'"]) == 2
    _one_line_error(capsys, "sft.task", "countdown", "fix")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "model").exists()


def test_sao_train_refusing_its_fp8_engine_sync_creates_no_run_directory(tmp_path, capsys):
    assert main(["train", str(TINY), f"run.output_dir='{tmp_path / 'runs'}'", f"model.path='{tmp_path / 'model'}'",
                 "rollout.engine_fp8=true", "weight_sync.method='shard_writes'"]) == 2
    _one_line_error(capsys, "weight_sync.method", "fix")
    assert not (tmp_path / "runs").exists()


def test_sft_on_good_pairs_passes_the_check(tmp_path):
    from sao_megatron.core.config import load_recipe

    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "1+1", "response": "2"}\n')
    recipe = load_recipe(str(TINY), [f"run.output_dir='{tmp_path}'", "sft.steps=2", f"sft.dataset='{data}'"])
    assert recipe.sft.dataset == str(data)


# ------------------------------------------------------------------------------------------ datasets
@pytest.mark.parametrize("field", ["rollout.dataset", "eval.datasets"])
@pytest.mark.parametrize("what", ["empty_dir", "model_dir", "binary", "not_rows"])
def test_a_dataset_that_is_not_one_is_refused_at_the_recipe_check(tiny_model_dir, tmp_path, capsys, field, what):
    target = {"empty_dir": tmp_path / "empty", "model_dir": tiny_model_dir, "binary": tmp_path / "x.jsonl",
              "not_rows": tmp_path / "x.json"}[what]
    if what == "empty_dir":
        target.mkdir()
    elif what == "binary":
        target.write_bytes(os.urandom(4000))
    elif what == "not_rows":
        target.write_text('{"prompt": "a dict, not a list of rows"}')
    value = f"'{target}'" if field == "rollout.dataset" else f"['{target}']"
    assert main(["train", str(TINY), f"run.output_dir='{tmp_path / 'runs'}'", f"model.path='{tiny_model_dir}'",
                 f"{field}={value}"]) == 2
    _one_line_error(capsys, field, str(target), "fix")
    assert not (tmp_path / "runs").exists()


def test_a_folder_of_jsonl_rows_passes_the_dataset_check(tmp_path):
    from sao_megatron.core.config.dataset_probe import probe_dataset

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    probe_dataset("rollout.dataset", str(tmp_path))                # a repository snapshot's layout
    probe_dataset("rollout.dataset", str(tmp_path / "data" / "train.jsonl"))


# ------------------------------------------------------------------------------------------ sao eval
@pytest.mark.parametrize("what", ["missing", "empty_dir", "a_file", "not_a_checkpoint"])
def test_eval_checkpoint_that_is_not_one_is_one_line(tmp_path, capsys, what):
    target = tmp_path / what
    if what == "empty_dir":
        target.mkdir()
    elif what == "a_file":
        target.write_text("hello")
    elif what == "not_a_checkpoint":
        (target / "checkpoints").mkdir(parents=True)
        (target / "config.json").write_text("{}")
    assert main(["eval", str(TINY), "--checkpoint", str(target), "eval.datasets=['task:arithmetic']",
                 f"run.output_dir='{tmp_path / 'runs'}'"]) == 2
    _one_line_error(capsys, "--checkpoint", str(target), "fix")
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------ sao init-model
def test_init_model_into_a_path_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["init-model", str(tmp_path / "file" / "model")]) == 2
    _one_line_error(capsys, "Not a directory", "fix")


def test_init_model_into_a_read_only_place_is_one_line(tmp_path, capsys, monkeypatch):
    # tests run as root, where chmod does not stop writes: refuse at the OS call instead
    real = os.mkdir

    def read_only(path, *args, **kw):
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *args, **kw)

    monkeypatch.setattr(os, "mkdir", read_only)
    assert main(["init-model", str(tmp_path / "model")]) == 2
    _one_line_error(capsys, "Read-only file system", "fix")


# ------------------------------------------------------------------------------------------ sao serve
def _serve(*argv: str) -> subprocess.CompletedProcess:
    # a subprocess: a check that let the server start would serve forever in this one
    return subprocess.run([sys.executable, "-m", "sao_megatron.cli.main", "serve", "--port", "0", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=GENEROUS_S)


@pytest.mark.parametrize("how", ["garbage", "lying_offsets"])
def test_serve_on_a_corrupt_model_is_one_line_before_it_loads(model_copy, how):
    _corrupt(model_copy, how)
    done = _serve("--model", str(model_copy))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--model" in done.stderr and "safetensors" in done.stderr and "fix" in done.stderr


def test_serve_with_a_max_batch_no_memory_holds_is_one_line(tiny_model_dir):
    done = _serve("--model", str(tiny_model_dir), "--max-batch", str(10 ** 30))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--max-batch" in done.stderr and "use at most" in done.stderr


# ------------------------------------------------------------------------------------------ overrides
@pytest.mark.parametrize("override", ['run.num_steps=3\n[run]\nname="other"', "run.name=abc\nmore",
                                      'run.num_steps=3\nrun.seed=4'])
def test_an_override_carrying_more_toml_is_refused(tmp_path, capsys, override):
    assert main(["train", str(TINY), f"run.output_dir='{tmp_path / 'runs'}'", override]) == 2
    _one_line_error(capsys, override.split("=")[0], "fix")
    assert not (tmp_path / "runs").exists()


def test_a_multi_line_toml_string_override_is_still_accepted():
    from sao_megatron.core.config.recipe import parse_override

    assert parse_override("rollout.system_prompt='''a\nb'''") == ("rollout.system_prompt", "a\nb")
