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
