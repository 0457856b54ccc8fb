"""Shard writes (weight_sync.method = "shard_writes"): each engine TP rank receives only its slice.

Against real reference servers (`--tp 2 --shard-writes`, HTTP + gloo, TP rank 1 a child process that
writes into the shared weights): the bytes each rank acks equal its slice of the model
(shard_plan.bytes_per_rank, less than the whole), the served weights equal the trainer's after the
sync (check_equal through /weights_checker), and two sender lanes run on their own groups in parallel.
A server started without the flag refuses, naming it; a slice that is not the rank's own is refused
by the rank, named in the push's error.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from checkpoints.hf_io import HFCheckpoint
from rollout.engines.engine import EngineError
from rollout.weights.check import check_weight_update_equal
from rollout.weights.shard_plan import COLUMN, REPLICATED, ROW, VOCAB, bytes_per_rank, rank_slice, split_kind
from rollout.weights.shard_writes import ShardWriteSync, flatten_slices
from sao_megatron.core.config import WeightSyncConfig


def _new_weights(model_dir, scale: float, seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    return [(n, t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype))
            for n, t in HFCheckpoint(model_dir).items()]


def _engine(srv, name):
    from rollout.engines.sglang_client import SGLangEngine

    return SGLangEngine(srv.url, api_key="k", name=name, control_timeout_s=30, weight_timeout_s=120)


def _launch(model_dir, *args):
    from rollout.engines.reference_server import launch_local

    return launch_local(model_dir, port=0, api_key="k", timeout_s=300, extra_args=list(args))


def test_split_rules_follow_the_layer_types():
    assert split_kind("model.layers.0.self_attn.q_proj.weight") == COLUMN
    assert split_kind("model.layers.0.mlp.experts.3.up_proj.weight") == COLUMN
    assert split_kind("model.layers.0.self_attn.o_proj.weight") == ROW
    assert split_kind("model.layers.0.mlp.experts.3.down_proj.weight") == ROW
    assert split_kind("model.embed_tokens.weight") == VOCAB == split_kind("lm_head.weight")
    assert split_kind("model.layers.0.mlp.gate.weight") == REPLICATED == split_kind("model.norm.weight")
    assert rank_slice("model.layers.0.self_attn.o_proj.weight", (8, 6), 2, 1) == (1, 3, 3)
    assert rank_slice("model.layers.0.self_attn.q_proj.weight", (8, 6), 2, 1) == (0, 4, 4)
    assert rank_slice("model.layers.0.self_attn.q_proj.weight", (7, 6), 2, 1) is None   # does not divide: whole
    assert rank_slice("model.norm.weight", (8,), 2, 0) is None


def test_flattened_slices_are_each_slices_bytes_in_order():
    """A row split (strided), a column split, a scalar: the payload is their bytes back to back, as the
    rank's typed views read them (the CPU copy goes through numpy, not torch)."""
    from rollout.weights.buckets import Bucket
    from rollout.weights.shard_plan import shard_of

    w = torch.randn(6, 8).to(torch.bfloat16)
    bucket = Bucket([], [])
    bucket.add("l.o_proj.weight", shard_of("l.o_proj.weight", w, 2, 1))      # columns 4..7: strided
    bucket.add("l.q_proj.weight", shard_of("l.q_proj.weight", w, 2, 0))      # rows 0..2: contiguous
    bucket.add("l.scale", torch.tensor(3.5))
    bucket = bucket.aligned()
    flat, buffer = flatten_slices(bucket, torch.full((4096,), 7, dtype=torch.uint8))
    expected = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in bucket.tensors])
    assert flat.numel() == bucket.nbytes == 4 + 2 * 24 * 2 and torch.equal(flat, expected)
    assert buffer.numel() == 4096 and flat.data_ptr() == buffer.data_ptr()   # the reused buffer, not a new one


def test_two_lanes_write_each_rank_its_slice_and_the_engines_match_the_trainer(tiny_model_dir):
    """Engines of TP 2 and TP 1, two sender lanes: lane 0 serves (tp2, rank 0) and (tp1, rank 0), lane 1
    serves (tp2, rank 1). Two pushes (groups reused); after each the servers hold the trainer's tensors."""
    servers = [_launch(tiny_model_dir, "--tp", "2", "--shard-writes"), _launch(tiny_model_dir, "--shard-writes")]
    pushes = [_new_weights(tiny_model_dir, 0.03, seed=1), _new_weights(tiny_model_dir, 0.05, seed=2)]

    async def scenario():
        engines = [_engine(servers[0], "tp2"), _engine(servers[1], "tp1")]
        try:
            sync = ShardWriteSync(WeightSyncConfig(method="shard_writes", bucket_mb=0.05, timeout_s=120), engines,
                                  ranks_per_engine=[2, 1], senders=2)
            lanes = [[(t.name, t.rank) for t in lane.targets] for lane in sync.lanes]
            outcomes = []
            for version, named in enumerate(pushes, start=3):
                async with sync.update_session():
                    await sync.push(named, version)
                checked = await check_weight_update_equal(engines, named)
                outcomes.append((dict(sync.received), [c.compared for c in checked],
                                 [await e.weight_version() for e in engines]))
            await sync.close()
            return lanes, outcomes
        finally:
            for e in engines:
                await e.close()

    try:
        lanes, outcomes = asyncio.run(scenario())
    finally:
        for s in servers:
            s.stop()
    assert lanes == [[("tp2", 0), ("tp1", 0)], [("tp2", 1)]]
    total = sum(t.numel() * t.element_size() for _, t in pushes[0])
    per_rank = bytes_per_rank(pushes[0], 2)
    assert per_rank[0] < 0.75 * total and per_rank[1] < 0.75 * total   # a broadcast sends each rank `total`
    for version, (received, compared, versions) in enumerate(outcomes, start=3):
        assert received == {("tp2", 0): per_rank[0], ("tp2", 1): per_rank[1], ("tp1", 0): total}
        assert compared == [47, 47] and versions == [version, version]


def test_server_without_the_flag_refuses_shard_writes_naming_it(tiny_model_dir):
    server = _launch(tiny_model_dir)

    async def scenario():
        engine = _engine(server, "plain")
        try:
            await ShardWriteSync(WeightSyncConfig(method="shard_writes", timeout_s=60), [engine]).connect()
        finally:
            await engine.close()

    try:
        with pytest.raises(EngineError, match=r"engine plain: joining .* --shard-writes"):
            asyncio.run(scenario())
    finally:
        server.stop()


def test_refusals_and_failed_exports_are_named_and_the_next_push_lands(tiny_model_dir, monkeypatch):
    """A sender that sends whole tensors (a broadcast's bytes) to a TP-2 rank: the rank writes nothing of
    them and its ack names the first tensor, so the push fails naming the engine and the rank. An export
    that breaks mid-stream fails the push naming the export. The next push after both lands."""
    import rollout.weights.shard_writes as sharded

    slicer = sharded.shard_of
    server = _launch(tiny_model_dir, "--tp", "2", "--shard-writes")
    named = _new_weights(tiny_model_dir, 0.02)

    def broken_export():
        yield from named[:40]
        raise RuntimeError("export broke")

    async def push(sync, tensors, version):
        async with sync.update_session():
            await sync.push(tensors, version)

    async def scenario():
        engine = _engine(server, "tp2")
        try:
            sync = ShardWriteSync(WeightSyncConfig(method="shard_writes", bucket_mb=0.05, timeout_s=60), [engine],
                                  ranks_per_engine=2, senders=2)
            monkeypatch.setattr(sharded, "shard_of", lambda name, tensor, tp, rank: tensor)
            with pytest.raises(EngineError, match=r"engine tp2 tp_rank [01]: refused shard writes: tp_rank [01]: "
                                                  r"weight .* holds"):
                await push(sync, named, 1)
            monkeypatch.setattr(sharded, "shard_of", slicer)
            with pytest.raises(EngineError, match=r"trainer export \(slicing\): .*export broke"):
                await push(sync, broken_export(), 2)
            await push(sync, named, 3)
            checked = await check_weight_update_equal([engine], named)
            return [c.compared for c in checked], await engine.weight_version()
        finally:
            await engine.close()

    try:
        assert asyncio.run(scenario()) == ([47], 3)
    finally:
        server.stop()


def test_sao_train_syncs_by_shard_writes_into_a_tp2_reference_server(tmp_path):
    """The trainer end to end with weight_sync.method = shard_writes, engine TP 2 (the server started with
    --tp 2 --shard-writes by the trainer) and check_equal after every push: two policy updates land."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[4]
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "train", str(repo / "recipes" / "tiny_moe_cpu.toml"),
           f"run.output_dir='{tmp_path}'", "run.name='shards'", f"model.path='{tmp_path / 'model'}'",
           "rollout.batch_size=8", "rollout.max_in_flight=8", "run.num_steps=2", "critic.warmup_steps=1",
           "weight_sync.method='shard_writes'", "rollout.engine_tp=2", "weight_sync.check_equal=true"]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "weight version 2" in proc.stdout + proc.stderr
    assert "2 weight-update rank(s)" in (tmp_path / "shards" / "engine0.log").read_text()
    rows = [json.loads(line) for line in (tmp_path / "shards" / "metrics.jsonl").read_text().splitlines() if line]
    assert sum(1 for r in rows if r.get("perf/weight_sync_sent_mb", 0) > 0) == 2


def test_shard_writes_with_sglang_engines_is_refused_naming_the_field():
    from sao_megatron.core.config import ConfigError, load_recipe

    with pytest.raises(ConfigError, match=r"weight_sync.method.*Mooncake transfer engine"):
        load_recipe(None, ["model.path='/nonexistent/model'", "weight_sync.method='shard_writes'",
                           "rollout.engine='sglang'"], check_files=False)


def test_a_holder_sends_only_the_engine_ranks_dealt_to_it():
    """With n ranks holding a tensor, holder i serves the engine rank slots equal to i mod n; a tensor one
    rank holds goes to every slot; each slot gets its own slice (engine TP 2: q_proj rows split)."""
    from rollout.weights.shard_writes import Target, _Lane

    lane = _Lane(0, [Target(e, f"e{e}", r, 2, slot=2 * e + r) for e in range(2) for r in range(2)])
    lane.start_push(1 << 20, 5.0)
    q = torch.arange(16.0).reshape(4, 4)
    lane.add("model.layers.0.self_attn.q_proj.weight", q, (1, 2))
    lane.add("model.norm.weight", torch.ones(4))
    assert [b.names for b in lane.pending] == [
        ["model.norm.weight"], ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"],
        ["model.norm.weight"], ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]]
    assert torch.equal(lane.pending[1].tensors[0], q[2:]) and torch.equal(lane.pending[3].tensors[0], q[2:])
