"""An engine fault that escapes the loop (an engine that died inside a weight-update window, where
the sync raises EngineError naming it) ends the rank with one `error:` line and exit 1, no traceback."""
from __future__ import annotations

import types

from rollout.engines.engine import EngineError
from sao_megatron.core.config.recipe import Recipe
from sao_megatron.trainer import entry


def test_engine_error_escaping_the_loop_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    import parallel.distributed as dist
    from sao_megatron.trainer import checkpointing

    async def dying_train(recipe, rank, world, verified=None):
        raise EngineError("engine http://10.77.0.11:30000 died during the weight update (connection refused)")

    monkeypatch.setattr(dist, "init_distributed", lambda *a, **k: types.SimpleNamespace(rank=0, world_size=1))
    monkeypatch.setattr(checkpointing, "resolve_resume", lambda recipe, rank, world, **kw: recipe)
    monkeypatch.setattr(entry, "_train", dying_train)
    recipe = Recipe()
    recipe.run.output_dir = str(tmp_path)
    assert entry.run_rank(recipe) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: engine http://10.77.0.11:30000 died during the weight update (connection refused) "
                   f"(run dir {recipe.run_dir})"]


def _fp8_checkpoint(path, quant: dict | None, model_type: str = "glm4_moe"):
    import json

    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type, **({"quantization_config": quant} if quant is not None else {})}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


BLOCK_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_fp8_engines_are_refused_before_anything_starts_unless_updates_can_land(monkeypatch, tmp_path):
    """rollout.engine_fp8 with SGLang needs a block-FP8 checkpoint (128x128, quant_method fp8) of a family
    whose loader was read, and broadcast or disk sync: anything else is refused on every rank, naming
    the field, before engines or models start. Accepted cases pass the check."""
    import parallel.distributed as dist
    import pytest

    from sao_megatron.core.config import ConfigError
    from sao_megatron.trainer.engines import check_engine_can_take_updates, engine_fp8_layout

    monkeypatch.setattr(dist, "init_distributed", lambda *a, **k: types.SimpleNamespace(rank=0, world_size=1))
    monkeypatch.setattr(entry, "_train", lambda *a: pytest.fail("training started"))
    recipe = Recipe()
    recipe.rollout.engine, recipe.rollout.engine_fp8 = "sglang", True
    refused = [
        (_fp8_checkpoint(tmp_path / "bf16", None), r"^rollout.engine_model_path: .*has no quantization_config"),
        (_fp8_checkpoint(tmp_path / "mx", {**BLOCK_FP8, "quant_method": "mxfp8"}), r"'mxfp8' is not supported"),
        (_fp8_checkpoint(tmp_path / "chan", {**BLOCK_FP8, "weight_block_size": None}), r"is not \[128, 128\]"),
        (_fp8_checkpoint(tmp_path / "llama", BLOCK_FP8, "llama"), r"model_type 'llama': its SGLang loader was not "
                                                                 r"checked.*; fix: set rollout.engine_fp8 = false"),
        (str(tmp_path / "missing"), r"config.json does not exist"),
    ]
    for method in ("broadcast", "disk"):
        recipe.weight_sync.method = method
        for path, match in refused:
            recipe.rollout.engine_model_path = path
            with pytest.raises(ConfigError, match=match):
                entry.run_rank(recipe)
    recipe.rollout.engine_model_path = _fp8_checkpoint(tmp_path / "ok", {**BLOCK_FP8, "ignored_layers": ["lm_head"]})
    check_engine_can_take_updates(recipe)
    assert engine_fp8_layout(recipe).ignored == ("lm_head", "model.lm_head")
    recipe.weight_sync.method = "shard_writes"
    with pytest.raises(ConfigError, match=r"^weight_sync.method: shard writes do not slice FP8 blocks"):
        check_engine_can_take_updates(recipe)
    recipe.rollout.engine = "reference"   # serves the block-FP8 version of model.path itself
    with pytest.raises(ConfigError, match=r"^weight_sync.method"):
        check_engine_can_take_updates(recipe)
    recipe.weight_sync.method = "broadcast"
    with pytest.raises(ConfigError, match=r"^rollout.engine_model_path: .*is a quantized checkpoint; the reference"):
        check_engine_can_take_updates(recipe)   # still the block-FP8 checkpoint above
    recipe.rollout.engine_model_path = _fp8_checkpoint(tmp_path / "plain", None, "qwen3_moe")
    check_engine_can_take_updates(recipe)
    recipe.rollout.engine_fp8 = False
    recipe.rollout.engine, recipe.weight_sync.method = "sglang", "shard_writes"
    check_engine_can_take_updates(recipe)
    assert engine_fp8_layout(recipe) is None
