"""`sao train` launching its own ranks: TP2 and DP2 give the single-rank run's numbers.

Only the first batch is deterministic: its prompts all start together under version-0 weights with
seeded sampling. Later batches hold whichever prompts finish first, which depends on timing (the
second batch differed between layouts under CI load). So the run is one step without critic warm-up:
the critic and the policy both train on the first batch, and their numbers must agree across layouts
to a small tolerance (reduction order differs between layouts; see docs/parallel.md).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_moe_cpu.toml"
KEYS = ["rollout/raw_reward", "rollout/response_len", "critic/vf_loss", "train/pg_loss", "train/grad_norm"]


def _train(tmp: Path, name: str, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "train", str(RECIPE), f"run.output_dir='{tmp}'",
           f"run.name='{name}'", f"model.path='{tmp / 'model'}'", "rollout.batch_size=8", "rollout.max_in_flight=8",
           "run.num_steps=1", "critic.warmup_steps=0", "logging.wandb=false", "checkpoint.resume='never'", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines() if line]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    return tmp, _train(tmp, "single")


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.world_size=2"]], ids=["tp2", "dp2"])
def test_layout_matches_single_rank(single, layout):
    tmp, reference = single
    rows = _train(tmp, "-".join(o.replace("parallel.", "").replace("=", "") for o in layout), *layout)
    assert len(rows) == len(reference) == 1
    got, ref = rows[0], reference[0]
    for key in KEYS:
        assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    assert got["train/route_agreement"] == ref["train/route_agreement"] == 1.0


def test_pipeline_stages_each_send_their_own_weights(single):
    """PP2 with per-stage senders: each stage's first rank broadcasts only its layers on its own group;
    the engine then holds every tensor of the trainer bit for bit (weight_sync.check_equal compares all
    of them after the sync) and the numbers equal the single-rank run."""
    tmp, reference = single
    rows = _train(tmp, "pp2", "parallel.pp=2", "weight_sync.senders='per_stage'", "weight_sync.check_equal=true")
    got, ref = rows[0], reference[0]
    for key in KEYS:
        assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    # rank 0 (stage 0) sent a strict part of the model: the other stage sent the rest
    assert 0 < got["perf/weight_sync_sent_mb"] < 0.9 * ref["perf/weight_sync_sent_mb"]


def test_resume_under_another_layout(single):
    """A checkpoint written by the single-rank run resumes under TP2 (Megatron distributed checkpoint:
    policy, critic and Adam states resharded; the driver's prompt cursor and buffer come from rank 0)."""
    tmp, reference = single
    ckpt = tmp / "single" / "checkpoints" / "step_00000001"
    assert (ckpt / "policy" / "sao_layout.json").is_file()
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "train", str(RECIPE), f"run.output_dir='{tmp}'",
           "run.name='resumed-tp2'", f"model.path='{tmp / 'model'}'", "rollout.batch_size=8", "rollout.max_in_flight=8",
           "run.num_steps=2", "critic.warmup_steps=0", "logging.wandb=false", f"checkpoint.resume='{ckpt}'",
           "parallel.tp=2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ckpt} at step 1, weight version 1" in proc.stderr
    rows = [json.loads(line) for line in (tmp / "resumed-tp2" / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in rows] == [2] and rows[0]["train/pg_loss"] == rows[0]["train/pg_loss"]
    # every sample of step 2 was generated under version 0, before the checkpoint: the buffered and
    # in-flight rollouts were carried over (fresh ones would be version 1, staleness 0)
    assert rows[0]["rollout/staleness"] == 1.0


@pytest.mark.parametrize("layout", [["parallel.world_size=2", "parallel.ep=2"], ["parallel.pp=2"], ["parallel.tp=2"]],
                         ids=["ep2", "pp2", "tp2"])
def test_shard_writes_come_from_every_rank(single, layout):
    """Shard writes from two trainer ranks into a TP-2 reference engine: every rank sends, from what its
    TP group gathered, its share (parallel/weights.py, scope "shares"): a tensor both ranks hold (TP2,
    or the dense weights replicated over DP under EP2) goes to engine rank 0 from trainer rank 0 and to
    engine rank 1 from trainer rank 1; one only rank 1 holds (EP2: experts 4-7; PP2: stage 1) leaves
    from rank 1 alone. No rank gathers the model. check_equal then finds every engine tensor equal to
    the trainer's, which what only rank 1 sent could make so; rank 0 sent a strict part of what the
    engine ranks received; the numbers equal the single-rank run."""
    from safetensors.torch import load_file

    from rollout.weights.shard_plan import bytes_per_rank

    tmp, reference = single
    name = "shards-" + layout[-1].split(".")[1].replace("=", "")
    rows = _train(tmp, name, *layout, "weight_sync.method='shard_writes'", "rollout.engine_tp=2",
                  "weight_sync.check_equal=true")
    got, ref = rows[0], reference[0]
    for key in KEYS:
        assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    hf = {}
    for shard in sorted((tmp / "model").glob("*.safetensors")):
        hf.update(load_file(shard))
    every_rank_received = sum(bytes_per_rank(hf.items(), 2)) / 2**20
    assert 0.1 * every_rank_received < got["perf/weight_sync_sent_mb"] < 0.9 * every_rank_received
