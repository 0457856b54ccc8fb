"""The weight-sync sender's memory (issue 17.5): the export streams, so during a push the sender holds
flat buffers, buckets and the tensor being gathered, never every tensor its rank owns; the recipe key
weight_sync.max_sender_mb bounds it, and the sender-memory check (rollout/weights/memory.py) refuses a
bound below what streaming needs.

The peak is measured with bench/parallel.py's LiveTensorPeak on the sender rank of a 2-rank TP gloo
layout, pushing to a LoopbackEngine (a child process) with BroadcastWeightSync; the mode is
thread-local, so it is entered in the push's worker threads too (flatten, broadcast: calls.pinned)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
import torch

from bench.parallel import CountInto, LiveTensorPeak
from parallel.distributed import run_distributed_test
from rollout.weights.memory import MIB, check_sender_memory, largest_tensor_elements, sender_need
from sao_megatron.core.config import ConfigError

BUCKET_MB = 0.01   # the check's own tests; the push is measured at two bucket sizes


def _push_peak(model_dir: str, bucket_mb: float) -> dict:
    """Rank 0 sends the TP2 policy to one loopback engine and measures its peak; rank 1 takes part in
    the export's collectives as a non-sender rank does (it drains its export)."""
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel
    from rollout.weights import broadcast as sync_module, calls
    from rollout.weights.check import check_weight_update_equal
    from rollout.weights.loopback_engine import LoopbackEngine
    from sao_megatron.core.config import WeightSyncConfig

    hf = load_file(f"{model_dir}/model.safetensors")
    model = RLModel.build(lc.make_recipe(model_dir, dict(tp=2)), "policy")
    model.load_hf_state_dict(hf)
    if torch.distributed.get_rank() == 1:
        for _ in model.export_hf():
            pass
        for _ in model.export_hf():   # the check_equal export below
            pass
        teardown_model_parallel()
        return {}
    mode = LiveTensorPeak()

    def counted(device, fn, *args):
        with CountInto(mode):
            return calls.pinned(device, fn, *args)

    sync_module.pinned = counted

    async def push():
        engine = LoopbackEngine("e0")
        try:
            sync = sync_module.BroadcastWeightSync(WeightSyncConfig(bucket_mb=bucket_mb, timeout_s=120), [engine])
            with mode:
                async with sync.update_session():
                    await sync.push(model.export_hf(), version=1)
            checked = await check_weight_update_equal([engine], model.export_hf())
            await sync.close()
            return [c.compared for c in checked], sync.bytes_sent
        finally:
            await engine.close()

    compared, sent = asyncio.run(push())
    teardown_model_parallel()
    return {"peak": mode.peak, "compared": compared, "sent": sent,
            "model_bytes": sum(t.numel() * t.element_size() for t in hf.values()), "tensors": len(hf)}


@pytest.mark.parametrize("bucket_mb", [0.01, 0.1])
def test_sender_peak_stays_within_the_smallest_bound_the_check_accepts(bucket_mb, tiny_model_dir):
    """Measured 0.23 MB (bucket 0.01 MiB; the bound 0.40) and 0.55 MB (0.1 MiB; the bound 0.62) of a
    2.0 MB model, which the old export held whole on the sender."""
    measured = run_distributed_test(_push_peak, world_size=2, timeout_s=600, args=(str(tiny_model_dir), bucket_mb))[0]
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    need = sender_need(hf, bucket_mb * MIB, element_bytes=4, tp=2)   # the policy trains in fp32 on CPU
    assert measured["compared"] == [measured["tensors"]]             # every tensor landed, equal
    assert measured["sent"] == measured["model_bytes"]
    assert 0 < measured["peak"] <= need.total
    # The old export held every tensor the sender's rank owned (here: all of them) until sent.
    assert measured["peak"] < measured["model_bytes"] / 3


def _recipe(model_dir, **weight_sync):
    from parallel import layout_check as lc

    recipe = lc.make_recipe(model_dir, dict(tp=2))
    recipe.parallel = replace(recipe.parallel, world_size=2)
    recipe.weight_sync = replace(recipe.weight_sync, **weight_sync)
    return recipe


def test_sender_memory_check_refuses_a_bound_below_what_streaming_needs(tiny_model_dir):
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    need = sender_need(hf, BUCKET_MB * MIB, element_bytes=4, tp=2)
    below = need.total / MIB * 0.9
    with pytest.raises(ConfigError) as err:
        check_sender_memory(_recipe(tiny_model_dir, bucket_mb=BUCKET_MB, max_sender_mb=below), hf)
    assert err.value.field == "weight_sync.max_sender_mb" and "\n" not in str(err.value)
    assert f"at least {int(need.total / MIB) + 1}" in str(err.value)
    check_sender_memory(_recipe(tiny_model_dir, bucket_mb=BUCKET_MB, max_sender_mb=need.total / MIB), hf)
    # the need grows with the bucket: two flat buffers, the bucket being filled and one held-back run
    bigger = sender_need(hf, 64 * MIB, element_bytes=4, tp=2)
    assert bigger.total == 4 * 64 * MIB + bigger.gather


def test_largest_tensor_is_the_fused_projection_or_the_padded_vocabulary():
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "vocab_size": 105, "intermediate_size": 128}
    assert largest_tensor_elements(cfg) == (4 + 2 * 2) * 32 * 64          # qkv
    assert largest_tensor_elements({**cfg, "vocab_size": 1000}) == 1024 * 64   # padded to 128
    assert largest_tensor_elements({**cfg, "intermediate_size": 1024}) == 2 * 1024 * 64   # fused gate+up
