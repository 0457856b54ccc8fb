"""One disk-sync push measured: the tiny model's tensors through DiskWeightSync to a loopback engine,
with the live-tensor peak of the push and of the thread that writes the shards (test_sender_memory_*)."""
from __future__ import annotations

import asyncio

from bench.parallel import CountInto, LiveTensorPeak


def disk_push_peak(model_dir, out_dir, monkeypatch, bucket_mb: float, fp8=None, after=None):
    """(peak bytes, the model's tensors, what `after(engine)` returned once the push landed). Each tensor
    is made anew at its turn (as the export gathers it)."""
    from safetensors.torch import load_file

    import checkpoints.hf_io as hf_io
    from rollout.weights.loopback_engine import LoopbackEngine
    from rollout.weights import DiskWeightSync
    from sao_megatron.core.config import WeightSyncConfig

    hf = load_file(f"{model_dir}/model.safetensors")
    mode, save = LiveTensorPeak(), hf_io.save_hf_checkpoint

    def counted(*args):
        with CountInto(mode):
            return save(*args)

    monkeypatch.setattr(hf_io, "save_hf_checkpoint", counted)

    async def push():
        engine = LoopbackEngine("e0")
        try:
            sync = DiskWeightSync(WeightSyncConfig(method="disk", bucket_mb=bucket_mb, timeout_s=120), [engine],
                                  out_dir, **({"fp8": fp8} if fp8 is not None else {}))
            with mode:
                await sync.push(((n, t.clone()) for n, t in hf.items()), version=1)
            return await after(engine) if after else None
        finally:
            await engine.close()

    result = asyncio.run(push())
    return mode.peak, hf, result
