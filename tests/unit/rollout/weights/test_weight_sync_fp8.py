"""FP8 engines over gloo: the trainer's block-FP8 sender against the reference server started with
`--quantization fp8` (a real process, HTTP + gloo), as SGLang serving a block-FP8 model:
- at start it serves the block-FP8 version of its checkpoint (check_equal against the round trip);
- a bf16 tensor for a weight it holds in FP8 is refused with a 400 naming the tensor, nothing written;
- an FP8 weight without its scale in the same call is refused naming the scale;
- after a push of FP8 blocks + scales it holds exactly their dequantized values (check_equal, all 47
  server tensors) and its logprobs equal an HF model loaded with those values;
- disk sync writes FP8 shards (float8 + scales) that it loads the same way;
- `sao train` with rollout.engine_fp8 end to end.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from checkpoints.hf_io import HFCheckpoint
from rollout.engines.engine import EngineError, GenerateRequest
from rollout.weights.check import WeightMismatchError, check_weight_update_equal
from rollout.weights.fp8_blocks import Fp8Layout, quantize_stream, round_trip_stream
from rollout.weights import BroadcastWeightSync
from sao_megatron.core.config import WeightSyncConfig

from test_weight_sync_reference_server import _engine, _hf_logprobs, _new_weights

LAYOUT = Fp8Layout()


@pytest.fixture(scope="module")
def fp8_server(tiny_model_dir):
    from rollout.engines.reference_server import launch_local

    srv = launch_local(tiny_model_dir, port=0, api_key="k", timeout_s=300, extra_args=["--quantization", "fp8"])
    yield srv
    srv.stop()


def _check(srv, named):
    async def scenario():
        engine = _engine(srv)
        try:
            return await check_weight_update_equal([engine], named)
        finally:
            await engine.close()
    return asyncio.run(scenario())


def _push(srv, named, fp8, version, bucket_mb=0.05):
    async def scenario():
        engine = _engine(srv)
        try:
            sync = BroadcastWeightSync(WeightSyncConfig(bucket_mb=bucket_mb, timeout_s=120), [engine], fp8=fp8)
            try:
                async with sync.update_session():
                    await sync.push(named, version=version)
                return sync.bytes_sent, await engine.weight_version()
            finally:
                await sync.close()
        finally:
            await engine.close()
    return asyncio.run(scenario())


def test_1_at_start_the_server_serves_the_block_fp8_version_of_its_checkpoint(fp8_server, tiny_model_dir):
    original = list(HFCheckpoint(tiny_model_dir).items())
    assert [c.compared for c in _check(fp8_server, round_trip_stream(original, LAYOUT))] == [47]
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.\d+\.(self_attn|mlp)\."):
        _check(fp8_server, original)   # the bf16/fp32 values themselves are not what it serves


def test_2_a_bf16_tensor_for_an_fp8_weight_is_refused_by_name_and_nothing_is_written(fp8_server, tiny_model_dir):
    """One update call with a norm and an attention projection in bf16: refused naming the projection,
    and neither is written (the call is checked whole before any write)."""
    new = dict(_new_weights(tiny_model_dir, 0.05))
    names = ["model.layers.0.input_layernorm.weight", "model.layers.2.self_attn.k_proj.weight"]
    named = [(n, new[n].to(torch.bfloat16)) for n in names]
    with pytest.raises(EngineError, match=r"weight 'model\.layers\.2\.self_attn\.k_proj\.weight' is held in FP8 by "
                                          r"this engine \(--quantization fp8\) but arrived as torch\.bfloat16"):
        _push(fp8_server, named, fp8=None, version=3, bucket_mb=64)
    original = list(HFCheckpoint(tiny_model_dir).items())
    assert [c.compared for c in _check(fp8_server, round_trip_stream(original, LAYOUT))] == [47]


def test_3_an_fp8_weight_without_its_scale_is_refused_naming_the_scale(fp8_server, tiny_model_dir):
    quantized = [(n, t) for n, t in quantize_stream(_new_weights(tiny_model_dir, 0.05), LAYOUT)
                 if n != "model.layers.1.self_attn.o_proj.weight_scale_inv"]
    with pytest.raises(EngineError, match=r"weight 'model\.layers\.1\.self_attn\.o_proj\.weight' arrived without "
                                          r"'model\.layers\.1\.self_attn\.o_proj\.weight_scale_inv'"):
        _push(fp8_server, quantized, fp8=None, version=4)


def test_4_fp8_push_lands_exactly_and_serves_the_trainers_fp8_logprobs(fp8_server, tiny_model_dir):
    named = _new_weights(tiny_model_dir, 0.05)
    sent, version = _push(fp8_server, named, fp8=LAYOUT, version=5)
    wire = sum(t.numel() * t.element_size() for _, t in quantize_stream(named, LAYOUT))
    full = sum(t.numel() * t.element_size() for _, t in named)
    assert version == 5 and sent == wire and wire < full / 2   # fp32 model: linear weights at 1 byte + scales
    served_values = list(round_trip_stream(named, LAYOUT))
    assert [(c.compared, c.layout) for c in _check(fp8_server, served_values)] == [(47, "hf")]

    async def generate():
        engine = _engine(fp8_server)
        try:
            return await engine.generate(GenerateRequest(rid="fp8-lp", input_ids=[5, 17, 33, 40], max_new_tokens=6,
                                                         temperature=1.0, seed=3, return_routed_experts=False))
        finally:
            await engine.close()
    result = asyncio.run(generate())
    expected = _hf_logprobs(tiny_model_dir, served_values, [5, 17, 33, 40], result.output_ids)
    assert (torch.tensor(result.output_logprobs) - expected).abs().mean().item() < 1e-5


def test_5_disk_sync_writes_fp8_shards_the_server_loads_as_blocks(fp8_server, tiny_model_dir, tmp_path):
    from safetensors import safe_open

    from rollout.weights import DiskWeightSync

    named = _new_weights(tiny_model_dir, 0.02)

    async def scenario():
        engine = _engine(fp8_server)
        try:
            sync = DiskWeightSync(WeightSyncConfig(method="disk", timeout_s=120), [engine], tmp_path, fp8=LAYOUT)
            await sync.push(named, version=6)
            return await engine.weight_version()
        finally:
            await engine.close()
    assert asyncio.run(scenario()) == 6
    shard = next((tmp_path / "v6").glob("*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        fp8 = [k for k in f.keys() if f.get_slice(k).get_dtype() == "F8_E4M3"]
    assert fp8 and all(f"{k}_scale_inv" in open_keys(tmp_path / "v6") for k in fp8)
    assert [c.compared for c in _check(fp8_server, round_trip_stream(named, LAYOUT))] == [47]


def open_keys(path):
    from safetensors import safe_open

    keys = set()
    for shard in path.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            keys |= set(f.keys())
    return keys


def test_sao_train_with_engine_fp8_sends_fp8_blocks_and_check_equal_holds(tmp_path):
    """The trainer end to end with rollout.engine_fp8 and a reference engine (started by the trainer with
    --quantization fp8) and check_equal after every push: two policy updates land as FP8 blocks, each
    push sending exactly the quantized model's bytes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[4]
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "train", str(repo / "recipes" / "tiny_moe_cpu.toml"),
           f"run.output_dir='{tmp_path}'", "run.name='fp8'", f"model.path='{tmp_path / 'model'}'",
           "rollout.batch_size=8", "rollout.max_in_flight=8", "run.num_steps=2", "critic.warmup_steps=1",
           "rollout.engine_fp8=true", "weight_sync.check_equal=true"]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "weight version 2" in proc.stdout + proc.stderr
    assert "weights served as 128x128 FP8 blocks" in (tmp_path / "fp8" / "engine0.log").read_text()
    rows = [json.loads(line) for line in (tmp_path / "fp8" / "metrics.jsonl").read_text().splitlines() if line]
    sent = [r["perf/weight_sync_sent_mb"] for r in rows if r.get("perf/weight_sync_sent_mb", 0) > 0]
    named = list(HFCheckpoint(tmp_path / "model").items())
    wire = sum(t.numel() * t.element_size() for _, t in quantize_stream(named, LAYOUT)) / 2**20
    assert len(sent) == 2 and sent == pytest.approx([wire, wire])
