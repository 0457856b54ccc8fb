"""Weight update: the trainer's new weights reach the rollout engines (docs/weights.md, docs/weight-transports.md).

The seam is `WeightSync.push(named_tensors, version)` (async), built by `build_weight_sync(cfg, engines,
role=...)` against engines in the `WeightReceiver` role. Who sends what is decided once, in plan.py; the
trainer's driver rank holds the update window around every push (sao_megatron/trainer/weight_updates.py):
the rollout driver pauses and resumes the engines (the one owner of pause/resume),
`WeightSync.update_session()` opens the engines' weight-update session.

| module | what |
|---|---|
| plan.py | `plan_weight_update`: each trainer rank's `SenderRole` (none, rank 0, stage, share), torch-free |
| memory.py | the sender's memory during a push and the weight_sync.max_sender_mb check, torch-free |
| base.py | `WeightSync` (the seam), the engine-facing base classes, `settle_caches`, `sender_address` |
| broadcast.py | `BroadcastWeightSync` (nccl or gloo): every engine rank receives every byte |
| shard_writes.py | `ShardWriteSync`: every engine TP rank receives only its slice |
| shard_plan.py | which slice of an HF tensor each engine TP rank holds (SGLang's layer split) |
| shard_wire.py | the messages of shard writes between one sender and one engine TP rank |
| disk.py | `DiskWeightSync`: HF shards on disk, loaded by every engine |
| factory.py | `build_weight_sync`: the transport named by weight_sync.method for one role |
| buckets.py | the flattened-bucket payload and the sender side of a weight-update group |
| bucketing.py | `iter_buckets`: a stream of tensors cut into buckets; runs of the model's memory sent without a copy |
| calls.py | labelled concurrent engine calls under one timeout (`run_all`, `PushError`), daemon-thread collectives |
| fp8_blocks.py | block-FP8 quantization of the weights an FP8 engine receives |
| fp8_checkpoint.py | the block-FP8 checkpoint an FP8 engine starts from (`sao convert hf-to-fp8`) |
| receiver.py | `WeightReceiver`: what weight sync needs from an engine (SGLangEngine implements it) |
| loopback_engine.py | `LoopbackEngine`: a WeightReceiver in a child process (bench, tests) |
| check.py | `check_weight_update_equal` (weight_sync.check_equal): engine checksums vs the trainer's |
| checksum.py | SGLang's /weights_checker tensor checksums, reproduced (CPU and GPU forms) |

The HF export and the name map stay in checkpoints/ (this package imports them; checkpoints imports
nothing of rollout: the layers contract in pyproject.toml).
"""
from __future__ import annotations

import importlib

# Public name -> the module that defines it. Imported on first use, so that the torch-free modules
# (plan.py, memory.py) load without torch: `sao plan` and the recipe checks read them.
_HOMES = {"WeightSync": "base", "settle_caches": "base", "BroadcastWeightSync": "broadcast", "PushError": "calls",
          "WeightMismatchError": "check", "check_weight_update_equal": "check", "DiskWeightSync": "disk",
          "build_weight_sync": "factory", "SenderRole": "plan", "WeightPlan": "plan", "plan_weight_update": "plan",
          "WeightReceiver": "receiver"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


__all__ = ["WeightReceiver", "WeightSync", "BroadcastWeightSync", "DiskWeightSync", "build_weight_sync",
           "settle_caches", "check_weight_update_equal", "WeightMismatchError", "PushError", "SenderRole",
           "WeightPlan", "plan_weight_update"]
