"""`sao train` through the reference server as SGLang 0.5.23 behaves (issue 14, point 4).

A GLM-4.5-class tiny model (layer 0 dense, so the routes' layer axis matters), sampling at
temperature 0.7 (the trainer must temper its logprobs as the engine does), an engine of two TP ranks
on the weight-update group, two pipeline stages that each send their own layers inside one
weight-update session per engine, full activation recompute (routes replayed per micro-batch in
backward), and check_equal comparing the engine's /weights_checker checksums with the trainer's
after every sync. The first step is on-policy: the engine's routes and logprobs must be reproduced
exactly (agreement 1.0, |trainer - engine| logprob < 1e-4). The second step runs on weights that
arrived through the sync. Disk sync under an in-place pause is the second run.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_moe_cpu.toml"
FAITHFUL = ["model.arch='glm4_moe'", "model.init_preset='tiny'", "rollout.temperature=0.7",
            "weight_sync.check_equal=true", "run.num_steps=2", "critic.warmup_steps=0", "logging.wandb=false",
            "checkpoint.resume='never'", "rollout.batch_size=8", "rollout.max_in_flight=8",
            # digits: a random model already earns reward, so step 1 changes the weights the sync carries
            "rollout.task='digits'"]


def _train(tmp: Path, name: str, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "train", str(RECIPE), f"run.output_dir='{tmp}'",
           f"run.name='{name}'", f"model.path='{tmp / 'glm'}'", *FAITHFUL, *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines() if line]


def _assert_on_policy_then_synced(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == [1, 2]
    first, second = rows
    assert first["rollout/staleness"] == 0.0
    assert first["train/route_agreement"] == 1.0
    assert first["train/train_rollout_logprob_abs_diff"] < 1e-4
    assert first["train/pg_clipfrac"] == 0.0
    assert first["train/grad_norm"] > 0   # the weights changed: the sync after step 1 carried new ones
    # check_equal compared the engine's checksums with the trainer's after each sync, or the run
    # would have stopped; step 2 trained on samples one version behind
    assert second["perf/weight_sync_s"] > 0 and second["rollout/staleness"] > 0
    assert second["train/train_rollout_logprob_abs_diff"] > first["train/train_rollout_logprob_abs_diff"]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("faithful")


def test_pp2_per_stage_senders_full_recompute_engine_tp2(tmp):
    rows = _train(tmp, "broadcast", "parallel.pp=2", "weight_sync.senders='per_stage'", "model.recompute='full'",
                  "rollout.engine_tp=2", "weight_sync.method='broadcast'")
    _assert_on_policy_then_synced(rows)
    assert "2 weight-update rank(s)" in (tmp / "broadcast" / "engine0.log").read_text()


def test_disk_sync_under_in_place_pause(tmp):
    rows = _train(tmp, "disk", "weight_sync.method='disk'", "weight_sync.pause_mode='in_place'")
    _assert_on_policy_then_synced(rows)
