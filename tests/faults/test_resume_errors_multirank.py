"""A checkpoint that fails verification inside the ranks of a multi-rank `sao train` (torchrun) is the
same one-line recipe error with exit 2 as in one process: no traceback from the ranks, none from
torchrun's failure report, and no model built (the checkpoint is verified by every rank together,
before any model; test_checkpoint_corruption.py holds the single-process side)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoint_corruption import _damage, _recipe, _save

from sao_megatron.trainer.checkpointing import RANK_ERROR_ENV, rank_recipe_error

REPO = Path(__file__).resolve().parents[2]

_NO_MODELS = """
import sys
import sao_megatron.trainer.components as components
def refuse(*args, **kwargs):
    raise SystemExit("models were built")
components._build_models = refuse
from sao_megatron.cli.main import main
sys.exit(main(["train", sys.argv[1], *sys.argv[2:]]))
"""


@pytest.mark.parametrize("resume", ["auto", "named"])
def test_two_rank_sao_train_refuses_a_corrupted_checkpoint_in_one_line_exit_2(tmp_path, resume):
    named = tmp_path / "runs" / "r" / "checkpoints" / "step_00000010"
    path = _recipe(tmp_path, resume="auto" if resume == "auto" else str(named))
    _save(named.parent, steps=(10,))
    _damage(named, "flip_shard")
    done = subprocess.run([sys.executable, "-c", _NO_MODELS, str(path), "parallel.pp=2", "parallel.launcher='torchrun'"],
                          capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 2, done.stderr
    assert "launching 2 ranks" in done.stderr                           # the ranks, not the parent, verified it
    lines = [line for line in done.stderr.splitlines() if "checkpoint.resume" in line]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("sao train: recipe error: checkpoint.resume: ") and lines[0].count("fix: ") == 1
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr
    assert "models were built" not in done.stderr
    assert not (tmp_path / "runs" / "r" / ".rank_recipe_error.json").exists()   # the hand-off is consumed
    assert json.loads((named / "manifest.json").read_text())["step"] == 10    # nothing was rewritten


def test_a_rank_outside_the_local_launcher_prints_from_rank_0_only_and_exits_2(monkeypatch, capsys):
    """Ranks started by srun or mpirun (no hand-off file): rank 0 prints the line, every rank exits 2."""
    from sao_megatron.core.config import ConfigError

    monkeypatch.delenv(RANK_ERROR_ENV, raising=False)
    err = ConfigError("checkpoint.resume", "no checkpoint in /x verifies", "start over with checkpoint.resume=never")
    assert rank_recipe_error(err, rank=1) == 2 and capsys.readouterr().err == ""
    assert rank_recipe_error(err, rank=0) == 2
    assert capsys.readouterr().err == f"sao train: recipe error: {err}\n"
