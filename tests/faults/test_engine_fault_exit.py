"""An engine fault that escapes the loop (an engine that died inside a weight-update window, where
the sync raises EngineError naming it) ends the rank with one `error:` line and exit 1, no traceback."""
from __future__ import annotations

import types

from rollout.engine import EngineError
from sao_megatron.core.config.recipe import Recipe
from sao_megatron.trainer import entry


def test_engine_error_escaping_the_loop_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    import parallel.distributed as dist
    from sao_megatron.trainer import checkpointing

    async def dying_train(recipe, rank, world):
        raise EngineError("engine http://10.77.0.11:30000 died during the weight update (connection refused)")

    monkeypatch.setattr(dist, "init_distributed", lambda *a, **k: types.SimpleNamespace(rank=0, world_size=1))
    monkeypatch.setattr(checkpointing, "resolve_resume", lambda recipe, rank, world: recipe)
    monkeypatch.setattr(entry, "_train", dying_train)
    recipe = Recipe()
    recipe.run.output_dir = str(tmp_path)
    assert entry.run_rank(recipe) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: engine http://10.77.0.11:30000 died during the weight update (connection refused) "
                   f"(run dir {recipe.run_dir})"]


def test_an_fp8_sglang_engine_is_refused_before_anything_starts(monkeypatch):
    """SGLang 0.5.23 cannot re-quantize our bf16 updates into an FP8 engine of our families: refused on
    every rank, naming the field, before engines or models start; a reference engine is unaffected."""
    import parallel.distributed as dist
    import pytest

    from sao_megatron.core.config import ConfigError
    from sao_megatron.trainer.engines import check_engine_can_take_updates

    monkeypatch.setattr(dist, "init_distributed", lambda *a, **k: types.SimpleNamespace(rank=0, world_size=1))
    monkeypatch.setattr(entry, "_train", lambda *a: pytest.fail("training started"))
    recipe = Recipe()
    recipe.rollout.engine, recipe.rollout.engine_fp8 = "sglang", True
    for method in ("broadcast", "disk"):
        recipe.weight_sync.method = method
        with pytest.raises(ConfigError, match=r"^rollout.engine_fp8: an FP8 SGLang engine cannot take this "
                                              r"trainer's bf16 weight updates.*; fix: set rollout.engine_fp8 = false"):
            entry.run_rank(recipe)
    recipe.rollout.engine_fp8 = False
    check_engine_can_take_updates(recipe)
