"""The run directory before any rank starts: its one-writer lock and its contents (the resolved recipe, the
base model when model.init_preset asks for one). Shared by `sao train` (entry.py) and the SFT stage (sft.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from sao_megatron.core.config import ConfigError, Recipe


def lock_if_first_rank(recipe: Recipe) -> None:
    """The run dir's one-writer lock (run_lock.py), taken by the process that launches the ranks, or by
    rank 0 where srun/mpirun started every rank with this entry point (the others share rank 0's run)."""
    rank = next((os.environ[k] for k in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID") if k in os.environ), "0")
    if rank == "0":
        from .run_lock import lock_run_dir

        recipe.run_dir.mkdir(parents=True, exist_ok=True)
        lock_run_dir(recipe.run_dir)


def prepare_run_dir(recipe: Recipe) -> Path:
    run_dir = recipe.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = Path(recipe.model.path)
    if not (model_dir / "config.json").exists():
        if not recipe.model.init_preset:
            raise ConfigError("model.path", f"{model_dir} has no config.json",
                              "create it with `sao init-model` or set model.init_preset")
        from checkpoints.init_model import init_model

        init_model(model_dir, arch=recipe.model.arch, preset=recipe.model.init_preset, seed=recipe.run.seed)
        print(f"created {recipe.model.arch}/{recipe.model.init_preset} model at {model_dir}", file=sys.stderr)
    recipe.dump(run_dir)
    return run_dir
