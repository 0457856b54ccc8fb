"""Where a step's time goes and how fast it trains: the perf/* metrics of every step.

    perf/time/{rollout_wait,logprobs,critic,policy,weight_sync}_s   wall seconds per phase (0 when absent)
    perf/tokens_per_s      trained tokens (prompt + response of the step's samples) / step seconds
    perf/train_tflops      model FLOPs of the step's passes / model seconds / trainer GPUs, per GPU, in TFLOP/s
    perf/mfu               perf/train_tflops / the device's dense bf16 peak (parallel/planner/hardware.py);
                           only where the device is in that table
    perf/max_memory_gib    torch.cuda.max_memory_allocated of this rank (GPU only)
    perf/pad_fraction      padding slots / computed slots over the step's micro-batches
    rollout/stale_drop_rate  samples dropped as stale / samples finished, during this step (driver counters)

The FLOPs are the planner's model (parallel/planner/timing.py forward_flops_per_token: 2 x active parameters
plus causal attention), summed per sample so each length gets its own attention term; a pass counts as one
forward, a training pass as three (forward + backward), as the planner's step time does.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Optional

import torch

from sao_megatron.core.records import Sample, TrainBatch

PHASES = ("rollout_wait", "logprobs", "critic", "policy", "weight_sync")
MODEL_PHASES = ("logprobs", "critic", "policy")   # the seconds the FLOPs were spent in


class StepClock:
    """Wall seconds per phase of one step, and the model passes run in it (for the FLOP count)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.passes = 0          # forward-pass equivalents over the whole batch (a training pass = 3)

    @contextlib.contextmanager
    def phase(self, name: str, passes: int = 0):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started
            self.passes += passes

    def metrics(self) -> dict:
        return {f"perf/time/{name}_s": self.seconds.get(name, 0.0) for name in PHASES}

    @property
    def model_seconds(self) -> float:
        return sum(self.seconds.get(name, 0.0) for name in MODEL_PHASES)


def pad_fraction(batches: list[TrainBatch]) -> float:
    """Padding slots / computed slots: a padded micro-batch computes rows x width positions, of which only
    `lengths` hold tokens (batching.py right-pads each row to the longest); a packed one (TrainBatch.packed)
    computes its real tokens back to back (the last few slots rounding the row up to the sequence multiple
    are not counted, as they are not for padded rows either)."""
    computed = sum(int(b.lengths.sum()) if getattr(b, "packed", False) else int(b.tokens.numel()) for b in batches)
    real = sum(int(b.lengths.sum()) for b in batches)
    return (computed - real) / computed if computed else 0.0


class SpeedMeter:
    """The perf/* numbers of a step from its clock, its samples and the run's FLOP model."""

    def __init__(self, hf_config: Optional[dict], world_size: int):
        self.hf_config, self.world_size = hf_config, max(world_size, 1)
        self.peak_tflops = device_peak_tflops()
        self._dropped = self._finished = None   # the driver's counters at the previous step

    def step_metrics(self, clock: StepClock, samples: list[Sample], step_seconds: float,
                     batches: Optional[list[TrainBatch]]) -> dict:
        tokens = sum(s.num_tokens for s in samples)
        out = clock.metrics() | {"perf/tokens_per_s": tokens / step_seconds if step_seconds > 0 else 0.0,
                                 "perf/pad_fraction": pad_fraction(batches) if batches else 0.0}
        flops = self.forward_flops(samples) * clock.passes
        tflops = flops / clock.model_seconds / self.world_size / 1e12 if clock.model_seconds > 0 else 0.0
        out["perf/train_tflops"] = tflops
        if self.peak_tflops:
            out["perf/mfu"] = tflops / self.peak_tflops
        if torch.cuda.is_available():
            out["perf/max_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        return out

    def forward_flops(self, samples: list[Sample]) -> float:
        """One forward pass over the samples under the planner's FLOP model (0 without a model config)."""
        if not self.hf_config:
            return 0.0
        from parallel.planner.timing import forward_flops_per_token

        return float(sum(forward_flops_per_token(self.hf_config, s.num_tokens) * s.num_tokens for s in samples))

    def stale_drop_rate(self, source_metrics: dict) -> float:
        """Dropped as stale / finished since the previous call, from the driver's cumulative counters
        (rollout/driver.py metrics: rollout/dropped_stale, rollout/finished); 0 for sources without them."""
        dropped, finished = source_metrics.get("rollout/dropped_stale"), source_metrics.get("rollout/finished")
        if dropped is None or finished is None:
            return 0.0
        before = (self._dropped or 0, self._finished or 0)
        self._dropped, self._finished = dropped, finished
        new_finished = finished - before[1]
        return (dropped - before[0]) / new_finished if new_finished > 0 else 0.0

    def start_counting(self, source_metrics: dict) -> None:
        """The driver's counters at the run's start (a resume restores them): the first step counts from here."""
        self._dropped = source_metrics.get("rollout/dropped_stale")
        self._finished = source_metrics.get("rollout/finished")


def device_peak_tflops() -> float:
    """Dense bf16 peak of this rank's GPU from the planner's table, 0 when unknown (or no GPU)."""
    if not torch.cuda.is_available():
        return 0.0
    from parallel.planner.hardware import GPUS

    name = torch.cuda.get_device_name().lower()
    return next((spec.bf16_tflops for key, spec in GPUS.items() if key in name), 0.0)


async def engine_load_metrics(engines: list, timeout_s: float = 5.0) -> dict:
    """engine/* from the engines' own load numbers (SGLangEngine.load: SGLang's /v1/loads), over the engines
    that answer within `timeout_s`: running and queued requests and generation tokens/s summed, the fullest
    engine's KV usage. Engines without such numbers (scripted ones) or that fail to answer are left out."""
    import asyncio

    clients = [engine for engine in engines if hasattr(engine, "load")]
    results = await asyncio.gather(*(asyncio.wait_for(e.load(), timeout_s) for e in clients), return_exceptions=True)
    loads = [r for r in results if isinstance(r, dict)]
    if not loads:
        return {}
    return {"engine/running_requests": sum(r["running_requests"] for r in loads),
            "engine/queued_requests": sum(r["queued_requests"] for r in loads),
            "engine/kv_usage": max(r["kv_usage"] for r in loads),
            "engine/gen_throughput_tok_s": sum(r["gen_throughput"] for r in loads)}
