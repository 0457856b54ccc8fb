"""The trainer's step metrics across DP ranks follow the algorithm library's rules (combine_metrics):
additive keys sum, ``*_max`` take the max and ``*_min`` the min over the ranks (gloo, 2 spawned ranks)."""
from __future__ import annotations

from parallel.distributed import run_distributed_test


def _reduce_on_two_ranks() -> dict:
    import torch.distributed as dist

    from parallel.stage_outputs import all_reduce_metrics

    rank = dist.get_rank()
    mine = {"pg_loss": 0.25 + rank, "ratio_max": [3.0, 1.5][rank], "ratio_min": [0.5, -2.0][rank],
            "adv_min": [-1.0, 4.0][rank]}
    return all_reduce_metrics(mine, group=dist.group.WORLD)


def test_dp_ranks_sum_additive_metrics_and_keep_the_extremes_of_max_and_min():
    first, second = run_distributed_test(_reduce_on_two_ranks, world_size=2, timeout_s=120)
    assert first == second == {"pg_loss": 1.5, "ratio_max": 3.0, "ratio_min": -2.0, "adv_min": -1.0}
