"""Run checkpoints on 2 gloo ranks: each rank saves and restores its own state through one atomic
checkpoint; a corrupted file of rank 1 stops both ranks at load (rank 1 names the file, rank 0 names
rank 1), so no rank continues alone into a collective that would hang."""
from __future__ import annotations

from parallel.distributed import run_distributed_test


def _save_load_corrupt(root: str) -> dict:
    import torch.distributed as dist

    from checkpoints.manifest import CheckpointCorruptError
    from checkpoints.run_state import RunCheckpointer, ValueState

    rank = dist.get_rank()
    mine = {"rank": rank, "weights": [rank * 10 + i for i in range(3)]}
    ckpt = RunCheckpointer(root, keep_last=1)
    ckpt.save(1, {"shard": ValueState(lambda: mine, lambda s: None)})
    mine = {"rank": rank, "weights": [0]}
    ckpt.save(2, {"shard": ValueState(lambda: mine, lambda s: None)})
    got = {}
    path = ckpt.load({"shard": ValueState(lambda: got, got.update)})
    out = {"loaded": dict(got), "path": path.name, "kept": [p.name for p in ckpt.list()]}
    dist.barrier()
    if rank == 1:
        f = path / "shard.rank00001.pt"
        f.write_bytes(f.read_bytes()[:-3])
    dist.barrier()
    try:
        ckpt.load({"shard": ValueState(dict, lambda s: None)})
        out["error"] = ""
    except CheckpointCorruptError as err:
        out["error"] = str(err)
    return out


def test_two_ranks_save_restore_and_stop_together(tmp_path):
    results = run_distributed_test(_save_load_corrupt, world_size=2, timeout_s=300, args=(str(tmp_path),))
    for rank, out in enumerate(results):
        assert out["loaded"] == {"rank": rank, "weights": [0]} and out["path"] == "step_00000002"
        assert out["kept"] == ["step_00000002"]
    assert "shard.rank00001.pt is truncated" in results[1]["error"]
    assert "rank(s) [1]" in results[0]["error"]
