"""The weight-sync sender's memory rules (rollout/weights/memory.py): torch-free, one copy of each
constant (the FP8 quantizer and the shard-writes lanes read theirs from memory.py at use, the vocabulary
padding is the model build's), and the weight_sync.max_sender_mb check runs where a run starts:
`sao train` and `sao launch` refuse a bound below the need in one line, before anything is written."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench.parallel import LiveTensorPeak
from rollout.weights import fp8_blocks, memory
from sao_megatron.cli.main import main

REPO = Path(__file__).resolve().parents[4]
TINY = REPO / "recipes" / "tiny_moe_cpu.toml"


def test_the_rules_import_without_torch():
    code = ("import sys; import rollout.weights.memory, rollout.weights.plan; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_fp8_quantizer_chunks_by_the_rules_bound(monkeypatch):
    """The quantizer's float32 temporaries follow memory.FP8_TEMP_CHUNK: cut to one block row, the peak
    drops to a fraction of the one-pass peak (the bound fp8_quantize_bytes counts is the quantizer's)."""
    w = torch.randn(1024, 2048, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    peaks = {}
    for chunk in (1 << 40, 1):
        monkeypatch.setattr(memory, "FP8_TEMP_CHUNK", chunk)
        with LiveTensorPeak() as mode:
            fp8_blocks.quantize_block_fp8(w)
        peaks[chunk] = mode.peak
    one_block_row = memory.FP8_TEMP_BYTES * memory.FP8_BLOCK * 2048
    scales = (1024 // memory.FP8_BLOCK) * (2048 // memory.FP8_BLOCK)
    outputs = w.numel() + 4 * scales                                  # the float8 copy and its scales
    assert peaks[1] <= outputs + one_block_row + 4 * scales * 4       # + the chunk's amax and masks
    assert peaks[1] < peaks[1 << 40] / 3
    assert fp8_blocks.BLOCK == (memory.FP8_BLOCK, memory.FP8_BLOCK)


def test_a_shard_writes_lane_queues_the_rules_depth(monkeypatch):
    from rollout.weights.shard_writes import ShardWriteSync
    from sao_megatron.core.config import WeightSyncConfig

    monkeypatch.setattr(memory, "SHARD_QUEUE_DEPTH", 5)
    cfg = WeightSyncConfig(method="shard_writes", shard_senders=1)
    lane = ShardWriteSync(cfg, [SimpleNamespace(name="e0")], ranks_per_engine=2).lanes[0]
    lane.start_push(1024, 1.0)
    assert lane.queue.maxsize == 5
    hf = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}
    deeper = memory.sender_need(hf, 1024, 4, method="shard_writes", lanes=1, targets=2)
    monkeypatch.setattr(memory, "SHARD_QUEUE_DEPTH", 2)
    shallower = memory.sender_need(hf, 1024, 4, method="shard_writes", lanes=1, targets=2)
    assert deeper.buckets - shallower.buckets == 3 * max(1024, deeper.largest)


def test_the_largest_tensor_has_the_model_builds_padded_vocabulary():
    from parallel import specs

    assert memory.padded_vocab_size is specs.padded_vocab_size
    hf = {"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 1000}
    for tp in (1, 3):
        assert memory.largest_tensor_elements(hf, tp) == specs.padded_vocab_size(1000, tp) * 8
    assert specs.padded_vocab_size(1000, 3) == 1152   # 128 * 3 when tp does not divide 128


class _Started(Exception):
    """Raised where the run would lock its run directory: the recipe checks passed."""


@pytest.mark.parametrize("bound_mb, refused", [(1, True), (32768, False)])
def test_sao_train_checks_the_sender_memory_before_the_run_starts(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                  bound_mb, refused):
    from sao_megatron.trainer import entry

    def started(recipe):
        raise _Started

    monkeypatch.setattr(entry, "lock_if_first_rank", started)
    args = ["train", str(TINY), f"run.output_dir='{tmp_path / 'runs'}'", f"model.path='{tiny_model_dir}'",
            f"weight_sync.max_sender_mb={bound_mb}"]
    if not refused:
        with pytest.raises(_Started):
            main(args)
        return
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "recipe error: weight_sync.max_sender_mb" in err and "fix:" in err, err
    assert "broadcast sender needs" in err and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("bound_mb, refused", [(1, True), (32768, False)])
def test_sao_launch_checks_the_sender_memory_before_writing_the_job(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                    bound_mb, refused):
    monkeypatch.chdir(tmp_path)
    code = main(["launch", str(TINY), f"run.output_dir='{tmp_path / 'runs'}'", f"model.path='{tiny_model_dir}'",
                 f"weight_sync.max_sender_mb={bound_mb}"])
    err = capsys.readouterr().err
    if not refused:
        assert code == 0 and any((tmp_path / "runs").rglob("*.sbatch")), err
        return
    assert code == 2 and err.count("\n") == 1 and "weight_sync.max_sender_mb" in err, err
    assert not (tmp_path / "runs").exists()
