"""Shard writes (weight_sync.method = "shard_writes") vs raw transports of the same model, on this CPU.
`sao bench weight_sync_sharded [--quick]`.

Setup, all on this machine: `engines` LoopbackShardEngine of TP `tp` (every TP rank a child process
that joins its lane's group and checks, then drops, what it receives), the sender lanes in this
process (one thread and one gloo group each). The payload is bench/weight_sync.py's synthetic MoE
state dict in bf16, `total_mb` MiB.

- shard writes: one session around push(named, version): per lane, slicing each tensor for each of
  its ranks, flattening, the wire (header, names, payload), then one ack per rank and the version.
- raw broadcast, same model: plain dist.broadcast of the model's bytes, in slices of the bucket size,
  to every engine rank on one group: what a broadcast transport's wire moves at least (each rank
  receives every byte).
- raw p2p, same bytes: on groups of the same topology (one per lane), plain sends of exactly the
  bucket sizes each rank receives under shard writes, the lanes in parallel: the transport's ceiling.

ratio_vs_raw_broadcast = raw broadcast s / shard writes s (target >= 0.85; above 1 when the
shard bytes are fewer than the broadcast's), ratio_vs_raw_p2p = raw p2p s / shard writes s (what
slicing, flattening and the protocol cost). Best of `repeats`, interleaved.
"""
from __future__ import annotations

import asyncio
import time

TARGET = 0.85


def bucket_sizes(named, tp: int, rank: int, bucket_bytes: int) -> list[int]:
    """The payload sizes rank `rank` receives: its slices, grouped as a sender lane groups them."""
    from rollout.weights.shard_plan import shard_nbytes

    sizes, current = [], 0
    for name, tensor in named:
        size = shard_nbytes(name, tuple(tensor.shape), tensor.element_size(), tp, rank)
        if current and current + size > bucket_bytes:
            sizes.append(current)
            current = 0
        current += size
    return sizes + ([current] if current else [])


def _send_raw(group, plan: list[list[int]]) -> None:
    """A raw lane: plain sends to group ranks 1.., round robin over the ranks as a lane's buckets come."""
    import torch
    import torch.distributed as dist

    buf = torch.empty(max((max(s) for s in plan if s), default=0), dtype=torch.uint8)
    for i in range(max(len(s) for s in plan)):
        for j, sizes in enumerate(plan):
            if i < len(sizes):
                dist.send(buf[: sizes[i]], dst=j + 1, group=group)


class _Raw:
    """The raw baselines' groups, formed once: one broadcast group of every engine rank, one p2p group per
    lane with the lane's ranks."""

    def __init__(self, sync, engines):
        import uuid

        self.sync, self.engines, self.p2p_groups = sync, engines, None
        self.tag = uuid.uuid4().hex[:6]   # group names are per process: a new _Raw needs new ones

    async def connect(self) -> None:
        from rollout.weights.buckets import create_sender_group
        from rollout.weights.calls import in_daemon_thread, run_all
        from sao_megatron.core.ports import free_port

        addr, backend, t = self.sync.master_address, self.sync.backend, self.sync.cfg.timeout_s
        port, world = free_port(""), 1 + sum(self.sync.engine_ranks)
        offsets = [1 + sum(self.sync.engine_ranks[:i]) for i in range(len(self.engines))]
        calls = {e.name: e.init_weights_update_group(addr, port, o, world, f"raw_bcast_{self.tag}", backend)
                 for e, o in zip(self.engines, offsets)}
        calls["sender"] = in_daemon_thread(create_sender_group, addr, port, world, f"raw_bcast_{self.tag}", backend, t)
        self.bcast_group = (await run_all(calls, "raw broadcast group", t))[-1]
        self.p2p_ports = [free_port("") for _ in self.sync.lanes]

    async def broadcast(self, nbytes: int, chunk: int) -> float:
        import torch

        from bench.weight_sync import broadcast_slices
        from rollout.weights.calls import in_daemon_thread, run_all

        flat = torch.empty(nbytes, dtype=torch.uint8)
        start = time.perf_counter()
        calls = {f"{e.name}/{r}": rank.receive_raw(nbytes, chunk, f"raw_bcast_{self.tag}")
                 for e in self.engines for r, rank in enumerate(e.ranks)}
        calls["sender"] = in_daemon_thread(broadcast_slices, flat, chunk, self.bcast_group)
        await run_all(calls, "raw broadcast", self.sync.cfg.timeout_s)
        return time.perf_counter() - start

    async def p2p(self, plans: list[list[list[int]]]) -> float:
        """Every lane's raw sends at once; the first call also forms the lanes' raw groups."""
        from rollout.weights.buckets import create_sender_group
        from rollout.weights.calls import in_daemon_thread, run_all

        addr, t, lanes = self.sync.master_address, self.sync.cfg.timeout_s, self.sync.lanes
        join = self.p2p_groups is None
        if join:
            self.p2p_groups = [None] * len(lanes)

        def lane(k: int) -> None:
            if join:
                self.p2p_groups[k] = create_sender_group(addr, self.p2p_ports[k], len(lanes[k].targets) + 1,
                                                         f"raw_p2p{k}_{self.tag}", self.sync.backend, t)
            _send_raw(self.p2p_groups[k], plans[k])
        calls = {target.label(): self.engines[target.engine].receive_p2p(
                     target.rank, addr, self.p2p_ports[k], j + 1, len(lanes[k].targets) + 1, f"raw_p2p{k}_{self.tag}",
                     plans[k][j], join)
                 for k in range(len(lanes)) for j, target in enumerate(lanes[k].targets)}
        start = time.perf_counter()
        calls |= {f"raw lane {k}": in_daemon_thread(lane, k) for k in range(len(lanes))}
        await run_all(calls, "raw p2p", t)
        return time.perf_counter() - start


async def _measure(total_mb: float, bucket_mb: float, lanes: list[int], num_engines: int, tp: int,
                   repeats: int) -> dict:
    from bench.weight_sync import synthetic_moe
    from rollout.weights.loopback_engine import LoopbackShardEngine
    from rollout.weights.shard_plan import bytes_per_rank
    from rollout.weights.shard_writes import ShardWriteSync
    from sao_megatron.core.config import WeightSyncConfig

    named = synthetic_moe(total_mb, layout="separate")   # what shard writes get: a snapshot export
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    bucket = int(bucket_mb * 2**20)
    per_rank = bytes_per_rank(named, tp)
    engines = [LoopbackShardEngine(f"loopback-{i}", tp) for i in range(num_engines)]
    rows = []
    try:
        for count in lanes:
            cfg = WeightSyncConfig(method="shard_writes", bucket_mb=bucket_mb, timeout_s=300)
            sync = ShardWriteSync(cfg, engines, ranks_per_engine=tp, senders=count)
            raw = _Raw(sync, engines)
            await raw.connect()
            plans = [[bucket_sizes(named, t.tp, t.rank, bucket) for t in lane.targets] for lane in sync.lanes]
            await raw.p2p(plans)                                   # forms the raw lanes' groups
            shard_t, bcast_t, p2p_t = [], [], []
            for r in range(repeats):
                bcast_t.append(await raw.broadcast(nbytes, bucket))
                p2p_t.append(await raw.p2p(plans))
                start = time.perf_counter()
                async with sync.update_session():
                    await sync.push(named, version=r + 1)
                shard_t.append(time.perf_counter() - start)
            assert all(sync.received[(e.name, r)] == per_rank[r] for e in engines for r in range(tp))
            await sync.close()
            best, b, p = min(shard_t), min(bcast_t), min(p2p_t)
            rows.append({"lanes": count, "seconds": best, "raw_broadcast_seconds": b, "raw_p2p_seconds": p,
                         "ratio_vs_raw_broadcast": b / best, "ratio_vs_raw_p2p": p / best})
    finally:
        for e in engines:
            await e.close()
    return {"bytes": nbytes, "tensors": len(named), "engines": num_engines, "tp": tp, "bucket_mb": bucket_mb,
            "bytes_per_rank": per_rank, "broadcast_bytes_per_rank": nbytes, "backend": "gloo", "sweep": rows}


def run(quick: bool = False) -> dict:
    cfg = dict(total_mb=64, bucket_mb=16, lanes=[2, 4], num_engines=2, tp=2, repeats=2) if quick else \
        dict(total_mb=256, bucket_mb=16, lanes=[1, 2, 4], num_engines=2, tp=2, repeats=3)
    result = asyncio.run(_measure(**cfg))
    best = max(result["sweep"], key=lambda s: s["ratio_vs_raw_broadcast"])
    mib = 2**20
    lines = [f"shard writes, {result['bytes'] / mib:.0f} MiB in {result['tensors']} tensors -> {result['engines']} "
             f"engines of TP {result['tp']} ({result['backend']}, {result['bucket_mb']:g} MiB buckets); each rank "
             f"receives {', '.join(f'{b / mib:.1f}' for b in result['bytes_per_rank'])} MiB (broadcast: "
             f"{result['bytes'] / mib:.0f} MiB each)"]
    lines += [f"  {s['lanes']} lane(s): shard writes {s['seconds']:.2f} s, "
              f"raw broadcast {s['raw_broadcast_seconds']:.2f} s "
              f"(ratio {s['ratio_vs_raw_broadcast']:.2f}), raw p2p of the same bytes {s['raw_p2p_seconds']:.2f} s "
              f"(ratio {s['ratio_vs_raw_p2p']:.2f})" for s in result["sweep"]]
    lines.append(f"best ratio vs raw broadcast {best['ratio_vs_raw_broadcast']:.2f} with {best['lanes']} lanes "
                 f"(target >= {TARGET})")
    result["summary"] = "\n".join(lines)
    result["best_ratio"] = best["ratio_vs_raw_broadcast"]
    return result


def section(r: dict, link) -> str:
    """The report's section (bench/registry.py)."""
    from bench.report_format import code_block, met

    best = max(r["sweep"], key=lambda s: s["ratio_vs_raw_broadcast"])
    text = (f"Target >= {TARGET} of a raw broadcast of the same model to the same engine ranks: "
            f"{met(best['ratio_vs_raw_broadcast'] >= TARGET)} (best {best['ratio_vs_raw_broadcast']:.2f} with "
            f"{best['lanes']} lanes; against raw sends of exactly the shard bytes {best['ratio_vs_raw_p2p']:.2f}). "
            "Shard writes are opt-in and need engines that take per-rank writes (docs/weights.md).")
    return "\n\n".join([code_block(r["summary"]), text])


if __name__ == "__main__":
    print(run(quick=True)["summary"])
