"""Weight-sync throughput: BroadcastWeightSync.push vs a raw torch.distributed broadcast of the same
bytes on the same process group, with a bucket-size sweep. `sao bench weight_sync [--quick]`.

Setup, all on this machine: the sender (this process, rank 0) and `engines` LoopbackEngine receivers
(child processes that speak the weight protocol exactly as SGLang ranks do, docs/engines.md) joined in
one gloo group (nccl with CUDA). The payload is a synthetic MoE-shaped state dict in bf16: per layer
attention + router tensors and `experts` expert triples (gate/up/down), `total_mb` MiB in all.

- raw: dist.broadcast of a uint8 tensor of the payload's total bytes (receivers post matching
  receives), once in one piece ("raw_one_shot") and once in slices of the bucket size ("raw at the
  same bucket size"): the transport's ceiling without names, HTTP calls, flattening or loading.
- sync: one weight-update session around push(named_tensors, version) = liveness (/model_info), per
  bucket (flatten + update call per engine concurrently with the broadcast + receiver unflatten), as
  the trainer runs it inside its update window (the engines are idle here: no pause to hold).
ratio_vs_raw = sync bytes/s / raw bytes/s at the same bucket size (target >= 0.85); ratio_vs_one_shot
compares with the single big broadcast. Each number is the best of `repeats` runs.
"""
from __future__ import annotations

import asyncio
import time

import torch


def synthetic_moe(total_mb: float, hidden: int = 512, experts: int = 16,
                  inter: int = 256) -> list[tuple[str, torch.Tensor]]:
    """MoE-shaped bf16 tensors until `total_mb` MiB; the values do not matter for throughput."""
    named, size, layer = [], 0, 0
    limit = total_mb * 2**20
    while size < limit:
        p = f"model.layers.{layer}."
        shapes = {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (hidden // 4, hidden),
                  p + "self_attn.v_proj.weight": (hidden // 4, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                  p + "mlp.gate.weight": (experts, hidden), p + "input_layernorm.weight": (hidden,)}
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            shapes |= {q + "gate_proj.weight": (inter, hidden), q + "up_proj.weight": (inter, hidden),
                       q + "down_proj.weight": (hidden, inter)}
        for name, shape in shapes.items():
            named.append((name, torch.ones(shape, dtype=torch.bfloat16)))
            size += named[-1][1].numel() * 2
        layer += 1
    return named


def _broadcast_slices(flat: torch.Tensor, chunk: int, group) -> None:
    from rollout.weights.buckets import broadcast_flat

    for start in range(0, flat.numel(), chunk):
        broadcast_flat(flat[start:start + chunk], group)


async def _raw(sync, engines, nbytes: int, chunk: int = 0) -> float:
    """Seconds for plain broadcasts of nbytes (in `chunk`-byte slices) on the sync's group, receivers done."""
    from rollout.weights.calls import in_daemon_thread, payload_device, pinned, run_all

    chunk = chunk or nbytes
    flat = torch.empty(nbytes, dtype=torch.uint8, device=payload_device(sync.backend))   # where push() sends from
    start = time.perf_counter()
    calls = {e.name: e.receive_raw(nbytes, chunk) for e in engines}
    calls["sender"] = in_daemon_thread(pinned, flat.device, _broadcast_slices, flat, chunk, sync.group)
    await run_all(calls, "raw broadcast", sync.cfg.timeout_s)
    return time.perf_counter() - start


async def _measure(total_mb: float, buckets_mb: list[float], num_engines: int, repeats: int) -> dict:
    from rollout.weights import BroadcastWeightSync
    from rollout.weights.loopback_engine import LoopbackEngine
    from sao_megatron.core.config import WeightSyncConfig

    named = synthetic_moe(total_mb)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    engines = [LoopbackEngine(f"loopback-{i}", keep_weights=False) for i in range(num_engines)]
    try:
        sync = BroadcastWeightSync(WeightSyncConfig(timeout_s=300), engines)
        await sync.connect()
        await _raw(sync, engines, 1 << 20)                                   # warm the connections
        raw_s = min([await _raw(sync, engines, nbytes) for _ in range(repeats)])
        sweep = []
        for mb in buckets_mb:
            sync.cfg.bucket_mb = mb
            times, raw_times = [], []
            for r in range(repeats):   # interleaved, so load changes on a shared machine hit both alike
                raw_times.append(await _raw(sync, engines, nbytes, int(mb * 2**20)))
                start = time.perf_counter()
                async with sync.update_session():
                    await sync.push(named, version=r + 1)
                times.append(time.perf_counter() - start)
            best, raw_b = min(times), min(raw_times)
            sweep.append({"bucket_mb": mb, "seconds": best, "bytes_per_s": nbytes / best, "raw_seconds": raw_b,
                          "raw_bytes_per_s": nbytes / raw_b, "ratio_vs_raw": raw_b / best,
                          "ratio_vs_one_shot": raw_s / best})
        await sync.close()
    finally:
        for e in engines:
            await e.close()
    return {"bytes": nbytes, "tensors": len(named), "engines": num_engines, "backend": sync.backend,
            "raw_one_shot_seconds": raw_s, "raw_one_shot_bytes_per_s": nbytes / raw_s, "sweep": sweep}


def run(quick: bool = False) -> dict:
    cfg = dict(total_mb=64, buckets_mb=[4, 16, 64], num_engines=2, repeats=2) if quick else \
        dict(total_mb=512, buckets_mb=[1, 4, 16, 64, 256], num_engines=2, repeats=3)
    result = asyncio.run(_measure(**cfg))
    best = max(result["sweep"], key=lambda s: s["ratio_vs_raw"])
    mib = 2**20
    lines = [f"weight sync, {result['bytes'] / mib:.0f} MiB in {result['tensors']} tensors -> "
             f"{result['engines']} engines ({result['backend']}); "
             f"raw one-shot broadcast {result['raw_one_shot_bytes_per_s'] / mib:.0f} MiB/s"]
    lines += [f"  bucket {s['bucket_mb']:>6g} MiB: sync {s['bytes_per_s'] / mib:6.0f} MiB/s, "
              f"raw {s['raw_bytes_per_s'] / mib:6.0f} MiB/s"
              f"  ratio {s['ratio_vs_raw']:.2f} (vs one-shot {s['ratio_vs_one_shot']:.2f})" for s in result["sweep"]]
    lines.append(f"best ratio {best['ratio_vs_raw']:.2f} at {best['bucket_mb']:g} MiB (target >= 0.85)")
    result["summary"] = "\n".join(lines)
    result["best_ratio"] = best["ratio_vs_raw"]
    return result


if __name__ == "__main__":
    print(run(quick=True)["summary"])
