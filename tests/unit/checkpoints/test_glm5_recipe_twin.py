"""The 750B-A40B recipe's weight path on its tiny twin: the tiny GLM-5 (MLA + DSA indexers, a shared indexer
layer, dense first layer) converted offline under the recipe's own layout kinds (pp and etp as the
recipe says; tp and ep capped at the twin's 4 heads and 8 experts) and back, bit for bit, indexers included; then to the
block-FP8 engine checkpoint the recipe's rollout.engine_model_path names. Loading into the trainer and
exporting under TP2/EP2/PP2 is tests/distributed/test_parallel_dsa.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "glm5_750b_a40b.toml"

pytestmark = pytest.mark.unit


def _sao(*argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "sao_megatron.cli.main", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_the_flagship_recipes_weight_path_round_trips_on_its_tiny_twin(tmp_path):
    from checkpoints.arch import load_recipe
    from checkpoints.hf_io import HFCheckpoint
    from checkpoints.tiny_models import make_tiny_hf

    recipe = load_recipe(RECIPE, check_files=False)
    assert recipe.model.arch == "glm5"
    twin = make_tiny_hf(tmp_path / "twin", "glm5", seed=6)
    config = json.loads((twin / "config.json").read_text())
    par = recipe.parallel
    layout = ["--tp", str(min(par.tp, config["num_attention_heads"])), "--pp", str(par.pp),
              "--ep", str(min(par.ep, config["n_routed_experts"])), "--etp", str(par.etp)]
    _sao("convert", "hf-to-mcore", str(twin), str(tmp_path / "mcore"), *layout)
    _sao("convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back"))
    original, back = dict(HFCheckpoint(twin)), dict(HFCheckpoint(tmp_path / "back"))
    assert any(".self_attn.indexer.wk.weight" in name for name in original)
    assert set(back) == set(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
    _sao("convert", "hf-to-fp8", str(twin), str(tmp_path / "fp8"))
    quant = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
