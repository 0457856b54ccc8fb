"""Rewards for the trainer fault tests, importable by a `sao train` subprocess (rollout.reward_fn)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path


async def hang_after_marking(sample) -> float:
    """Marks $SAO_FAULT_MARKER (collection has begun, handlers are installed), then never returns."""
    Path(os.environ["SAO_FAULT_MARKER"]).touch()
    await asyncio.sleep(3600)
    return 0.0


def always_raise(sample) -> float:
    raise RuntimeError("the reward service is down")


def zero_and_disk_full_from_step_2(sample) -> float:
    """A reward of 0; naming it in rollout.reward_fn makes every checkpoint save after step 1 fail with
    ENOSPC part-way through its first file (the patch below runs when the trainer imports this module)."""
    return 0.0


def _disk_full_from_step_2() -> None:
    import errno

    from checkpoints import run_state

    real = run_state._save_durably

    def save(obj, path):
        if path.parent.name >= ".tmp-step_00000002":
            path.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(obj, path)

    run_state._save_durably = save


def _disk_full_in_the_distributed_policy_from_step_2() -> None:
    """Megatron's torch_dist writer opens each shard file with the builtin open (filesystem_async.py:383,
    in forked writer processes too, which inherit this patch): it finds the disk full from step 2."""
    import builtins
    import errno

    real = builtins.open

    def full_open(file, mode="r", *args, **kwargs):
        if "w" in str(mode) and f"{os.sep}.tmp-step_00000002{os.sep}policy{os.sep}" in str(file):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return real(file, mode, *args, **kwargs)

    builtins.open = full_open


if os.environ.get("SAO_FAULT_DISK_FULL") == "1":   # only in the `sao train` subprocess that asks for it
    _disk_full_from_step_2()
elif os.environ.get("SAO_FAULT_DISK_FULL") == "policy":
    _disk_full_in_the_distributed_policy_from_step_2()
