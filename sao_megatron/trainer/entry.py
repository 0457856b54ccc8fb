"""From a validated recipe to running ranks: run dir, model creation, rank launch, the loop.

Exit codes of `sao train`: 0 when the run finished, or stopped on SIGTERM/SIGUSR1 after saving the
last completed step; 1 when a fault stopped it (one line on stderr naming the cause, the last
completed step saved when the state allowed); 2 for a recipe error (sao_megatron/cli/main.py).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

from checkpoints.arch import load_recipe
from sao_megatron.core.config import ConfigError, Recipe

from .run_dir import lock_if_first_rank, prepare_run_dir


def train_from_recipe(recipe: Recipe) -> int:
    """Entry point of `sao train`. Launches ranks itself when the recipe asks for more than one."""
    if recipe.sft.steps > 0:
        from .sft import check_sft_data

        check_sft_data(recipe)   # a recipe refused for its SFT data creates nothing, run dir included
    from rollout.weights.memory import check_sender_memory

    from .engines import check_engine_can_take_updates

    check_engine_can_take_updates(recipe)   # likewise a refused FP8 engine checkpoint (ranks check it again)
    check_sender_memory(recipe)   # weight_sync.max_sender_mb against model.path's config.json
    lock_if_first_rank(recipe)   # before anything is written: a second run into a live run dir touches nothing
    run_dir = prepare_run_dir(recipe)
    from sao_megatron.core.processes import reap_descendants_at_exit

    reap_descendants_at_exit()   # nothing this run starts outlives it, even after a SIGKILL
    if recipe.sft.steps > 0:   # the paper's order: SFT first (once), then RL from its model
        from .sft import chain_sft

        recipe = chain_sft(recipe)
    world = recipe.parallel.resolved_world_size()
    if world > 1 and "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ \
            and "SLURM_PROCID" not in os.environ:
        return launch_local_ranks(recipe, run_dir / "resolved_recipe.toml", world)
    return run_rank(recipe)


def launch_local_ranks(recipe: Recipe, resolved: Path, world: int) -> int:
    """Start `world` ranks on this machine (torchrun, or mpirun via mpi4py) running this same recipe."""
    launcher = recipe.parallel.launcher
    if launcher == "auto":
        launcher = "torchrun"
    module = [sys.executable, "-m", "sao_megatron.trainer.rank_main", str(resolved)]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] + module[1:]
    elif launcher == "mpirun":
        mpirun = shutil.which("mpirun") or str(Path(sys.executable).parent / "mpirun")
        cmd = [mpirun, "-np", str(world), "--oversubscribe"] + module
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    else:
        raise ConfigError("parallel.launcher", f"world_size {world} needs a launcher, got 'none'",
                          "set parallel.launcher = 'torchrun' or start the ranks yourself")
    print(f"launching {world} ranks: {' '.join(cmd)}", file=sys.stderr)
    from checkpoints.preemption import DEFAULT_SIGNALS
    from sao_megatron.core.processes import forward_signals_to_children

    from .checkpointing import RANK_ERROR_ENV, raise_rank_recipe_error

    handoff = resolved.parent / ".rank_recipe_error.json"   # a recipe error the ranks found (checkpointing.py)
    handoff.unlink(missing_ok=True)
    # its own session: Ctrl-C at the terminal reaches this process only, which forwards it once to the
    # ranks (torchrun would pass it on too, and a rank's second signal exits without saving)
    launcher_proc = subprocess.Popen(cmd, env={**os.environ, RANK_ERROR_ENV: str(handoff)}, start_new_session=True)
    with forward_signals_to_children(launcher_proc.pid, DEFAULT_SIGNALS):   # the ranks save, then exit 0
        code = launcher_proc.wait()
    raise_rank_recipe_error(handoff)
    return code


def run_rank(recipe: Recipe) -> int:
    """One trainer rank: join the process group, build the components, run the loop."""
    from parallel.distributed import init_distributed, single_process_port
    from sao_megatron.metrics.console import quiet_missing_kernel_warnings

    quiet_missing_kernel_warnings()   # before Megatron's first import (the CPU shim's); `sao doctor` explains them
    single_process_port()
    env = init_distributed("auto")
    from .checkpointing import rank_recipe_error, resolve_resume

    from .engines import check_engine_can_take_updates

    verified: dict = {}   # the chosen checkpoint's manifest: verified (checksummed) once, here
    try:
        check_engine_can_take_updates(recipe)    # every rank, before any engine or model is built
        recipe = resolve_resume(recipe, env.rank, env.world_size, verified=verified)   # before any model is built
    except ConfigError as err:
        if env.world_size == 1:
            raise                      # `sao train` itself prints it: one line, exit 2
        return rank_recipe_error(err, env.rank)
    from checkpoints.run_state import CheckpointWriteError
    from rollout.engines.engine import EngineError

    from .agreement import RankFailed
    from .stopping import CollectionStopped

    try:
        state, stopped, saved = asyncio.run(_train(recipe, env.rank, env.world_size, verified or None))
    except (CollectionStopped, EngineError, RankFailed, CheckpointWriteError) as err:   # a rollout or engine fault (e.g. an engine
        # that died inside a weight-update window) or a rank's failure (agreement.py, its traceback in the
        # run dir): its one line, no traceback; the run dir holds the last checkpoint
        print(f"error: {err} (run dir {recipe.run_dir})", file=sys.stderr)
        return 1
    if env.rank == 0:
        how = f"{state.step} steps"
        if stopped:
            how = f"stopped by {stopped} after step {state.step}, " + ("checkpoint saved" if saved else "no checkpoint")
        print(f"done: {how}, weight version {state.version}; run dir {recipe.run_dir}", file=sys.stderr)
    return 0


async def _train(recipe: Recipe, rank: int, world_size: int, verified: dict | None = None):
    from .components import build_components
    from .loop import Trainer
    from .state import TrainerState

    state = TrainerState()
    async with build_components(recipe, rank, world_size) as parts:
        parts.checkpoints.verified = verified
        trainer = Trainer(recipe, parts, state)
        await trainer.train()
    return state, trainer.stopped, trainer.saved_at_stop


def rank_main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return run_rank(load_recipe(args[0], args[1:]))


if __name__ == "__main__":
    sys.exit(rank_main())
