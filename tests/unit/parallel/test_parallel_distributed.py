"""Rank discovery (torchrun / mpirun / srun) and the test spawner's failure paths."""
from __future__ import annotations

import time

import pytest
import torch

from parallel.distributed import DistributedTestError, detect_rank_env, run_distributed_test


@pytest.mark.parametrize("env, expect", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, (3, 8, 1, "torchrun")),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, (5, 6, 2, "mpirun")),
    ({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3"}, (7, 16, 3, "srun")),
    ({}, (0, 1, 0, "single")),
])
def test_detect_rank_env(env, expect):
    info = detect_rank_env(env)
    assert (info.rank, info.world_size, info.local_rank, info.source) == expect


def _fail_on_rank_one():
    if torch.distributed.get_rank() == 1:
        raise ValueError("boom from rank one")
    torch.distributed.barrier()  # rank 0 would wait forever for rank 1 without the spawner's kill


def _sleep_forever():
    time.sleep(3600)


def _rank_and_sum():
    t = torch.tensor([float(torch.distributed.get_rank() + 1)])
    torch.distributed.all_reduce(t)
    return torch.distributed.get_rank(), float(t)


def test_results_in_rank_order():
    assert run_distributed_test(_rank_and_sum, world_size=2, timeout_s=120) == [(0, 3.0), (1, 3.0)]


def test_failing_rank_traceback_is_raised_not_hung():
    with pytest.raises(DistributedTestError, match=r"rank 1 failed:\nValueError: boom from rank one") as info:
        run_distributed_test(_fail_on_rank_one, world_size=2, timeout_s=120)
    assert "_fail_on_rank_one" in str(info.value)  # the rank's traceback travels with it


def test_stuck_rank_is_killed_after_timeout():
    with pytest.raises(DistributedTestError, match=r"ranks \[0\] did not finish within 15s"):
        run_distributed_test(_sleep_forever, world_size=1, timeout_s=15)
