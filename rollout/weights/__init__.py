"""Weight sync: the rollout side's intake of the trainer's weights (docs/weights.md).

The seam is `WeightSync.push(named_tensors, version)` (async), built by `build_weight_sync(cfg, engines)`,
against engines in the `WeightReceiver` role. The trainer's driver rank holds the update window
around every push (sao_megatron/trainer/weight_updates.py): the rollout driver pauses and resumes the
engines (the one owner of pause/resume), `WeightSync.update_session()` opens the engines'
weight-update session.

| module | what |
|---|---|
| receiver.py | `WeightReceiver`: what weight sync needs from an engine (SGLangEngine implements it) |
| sync.py | `WeightSync`, `BroadcastWeightSync` (nccl or gloo), `DiskWeightSync` (HF shards), `build_weight_sync`, `settle_caches` |
| buckets.py | the flattened-bucket payload and the sender side of the weight-update group |
| calls.py | labelled concurrent engine calls under one timeout (`run_all`), daemon-thread collectives, device pinning |
| check.py | `check_weight_update_equal` (weight_sync.check_equal): engine checksums vs the trainer's |
| loopback_engine.py | `LoopbackEngine`: a WeightReceiver in a child process (bench, tests) |

The HF export and the name map stay in checkpoints/ (this package imports them; checkpoints imports
nothing of rollout: the layers contract in pyproject.toml).
"""
from .check import WeightMismatchError, check_weight_update_equal
from .receiver import WeightReceiver
from .sync import BroadcastWeightSync, DiskWeightSync, WeightSync, build_weight_sync, settle_caches

__all__ = ["WeightReceiver", "WeightSync", "BroadcastWeightSync", "DiskWeightSync", "build_weight_sync",
           "settle_caches", "check_weight_update_equal", "WeightMismatchError"]
