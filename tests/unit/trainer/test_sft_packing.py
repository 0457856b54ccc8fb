"""SFT with packed sequences (parallel.pack_sequences): `sao sft`'s micro-batches come from the RL path's
packer (trainer/batching.py pack_samples), so packed ones hold the samples back to back and compute fewer
slots, and the tiny model's SFT losses, grad norms and per-token logprobs equal the padded path's.

Tolerances (fp32, CPU, one rank) as in tests/distributed/test_packed_sequences.py: logprobs 2e-6 absolute,
losses 1e-6 absolute, grad norms 1e-5 relative. The packed budget counts real tokens, so the two paths
group the samples into different micro-batches: the step's sums run in another order, nothing more (the
loss divides by the step's response-token count either way).
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel.distributed import run_distributed_test
from parallel.packing import PackedLayout
from sao_megatron.trainer.sft import sft_batches
from sao_megatron.trainer.speed import pad_fraction

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "tiny_sft_sao_cpu.toml"
LOGP_TOL, LOSS_TOL, GRAD_REL_TOL = 2e-6, 1e-6, 1e-5
BUDGET = 96            # several padded micro-batches of the pairs below, fewer packed ones


def _pairs(n: int = 12, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Ragged prompt/response pairs (token ids inside the tiny model's vocabulary)."""
    rng = random.Random(seed)
    return [([rng.randrange(7, 60) for _ in range(rng.randint(3, 20))],
             [rng.randrange(7, 60) for _ in range(rng.randint(2, 16))]) for _ in range(n)]


def _rows_by_uid(batches) -> dict[str, list[int]]:
    return {uid: b.tokens[r, :int(b.lengths[r])].tolist() for b in batches for r, uid in enumerate(b.sample_uids)}


def test_packed_sft_batches_hold_the_same_samples_in_fewer_computed_slots():
    padded = sft_batches(_pairs(), BUDGET)
    packed = sft_batches(_pairs(), BUDGET, packed=True)
    assert all(b.packed for b in packed) and not any(b.packed for b in padded)
    assert _rows_by_uid(packed) == _rows_by_uid(padded)
    assert packed[0].global_num_tokens == padded[0].global_num_tokens == sum(len(r) for _, r in _pairs())
    assert all(int(b.lengths.sum()) <= BUDGET for b in packed)       # the budget counts real tokens
    assert len(packed) < len(padded)
    assert pad_fraction(packed) == 0.0 < pad_fraction(padded)
    # one micro-batch of every sample: the model computes the packed row's width, not rows x longest
    whole_padded, whole_packed = sft_batches(_pairs(), 4096)[0], sft_batches(_pairs(), 4096, packed=True)[0]
    assert PackedLayout.of(whole_packed).width == int(whole_packed.lengths.sum()) < whole_padded.tokens.numel()


def _real(logp: torch.Tensor, batches) -> dict[str, torch.Tensor]:
    """Each sample's logprobs at its real positions, by uid (the two paths put samples in other rows)."""
    out = {}
    for lp, b in zip(logp, batches):
        for r, uid in enumerate(b.sample_uids):
            out[uid] = lp[r, :int(b.lengths[r])]
    return out


def _sft_run(model_dir: str, packed: bool) -> dict:
    """On one rank: the SFT policy as `sao sft` builds it, its logprobs on the step's micro-batches, then two
    SFT steps on them (the second's loss follows one optimizer step)."""
    from parallel.distributed import teardown_model_parallel
    from sao_megatron.core.config import load_recipe
    from sao_megatron.trainer.sft import _build_policy, sft_loss_fn

    teardown_model_parallel()
    torch.manual_seed(0)
    recipe = load_recipe(RECIPE, [f"model.path='{model_dir}'", "sft.lr=1e-3"], check_files=False)
    policy = _build_policy(recipe)
    batches = sft_batches(_pairs(), BUDGET, packed=packed)
    logp = _real([lp for lp, _ in policy.compute_logprobs(batches)], batches)
    steps = [policy.train_step(batches, sft_loss_fn) for _ in range(2)]
    teardown_model_parallel()
    return {"logp": logp, "steps": [{k: s[k] for k in ("sft_loss", "grad_norm")} for s in steps]}


def _run(model_dir: Path, packed: bool) -> dict:
    return run_distributed_test(_sft_run, world_size=1, timeout_s=400, args=(str(model_dir), packed))[0]


def test_packed_sft_equals_padded_sft(tiny_model_dir):
    padded, packed = _run(tiny_model_dir, False), _run(tiny_model_dir, True)
    assert padded["logp"].keys() == packed["logp"].keys()
    for uid, lp in padded["logp"].items():
        assert float((lp - packed["logp"][uid]).abs().max()) < LOGP_TOL, uid
    for a, b in zip(padded["steps"], packed["steps"]):
        assert abs(a["sft_loss"] - b["sft_loss"]) < LOSS_TOL
        assert abs(a["grad_norm"] - b["grad_norm"]) <= GRAD_REL_TOL * a["grad_norm"]
    first, second = padded["steps"]
    assert first["grad_norm"] > 0 and second["sft_loss"] < first["sft_loss"]   # it trained: not a no-op


def test_sao_sft_trains_packed_and_logs_pad_fraction(tmp_path, tiny_model_dir):
    """`sao sft` with parallel.pack_sequences = true (the tiny recipe sets false) packs its micro-batches."""
    cmd = [sys.executable, "-m", "sao_megatron.cli.main", "sft", str(RECIPE), f"run.output_dir='{tmp_path}'",
           "run.name='packed'", f"model.path='{tiny_model_dir}'", "logging.wandb=false", "rollout.task='chain:1:1'",
           "sft.steps=2", "sft.batch_size=8", "parallel.pack_sequences=true"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "packed" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["perf/pad_fraction"] == 0.0 and r["train/sft_loss"] > 0 for r in rows)
