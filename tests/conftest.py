"""Shared fixtures and the test tiers.

Tiers follow the folder: tests/unit (default), tests/distributed (2+ ranks over gloo), tests/faults
(the fault and bad-input suite), tests/learning (the demo learns its task, end to end), tests/slurm
(a running single-node slurm), tests/multinode, tests/gpu (CUDA; skipped here with the reason shown).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Test helpers shared across folders (the SGLang wheel reader, HTTP helpers, fakes): `from sglang_wheel import ...`.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

TIERS = {"unit", "distributed", "faults", "learning", "slurm", "multinode", "gpu"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).parts
        tier = next((p for p in parts if p in TIERS), "unit")
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu" or item.get_closest_marker("gpu"):
            reason = _gpu_missing_reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_sessionfinish(session, exitstatus):
    """Tests that build a model in this process leave Megatron's groups and torch's default gloo group
    alive; torn down by the interpreter at exit, their native threads can abort it ("terminate called
    without an active exception", exit 134, seen once after a green run). Destroy them here, in order."""
    import sys

    if "torch" not in sys.modules:
        return
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            from parallel.distributed import teardown_model_parallel

            teardown_model_parallel()
        finally:
            torch.distributed.destroy_process_group()


def _gpu_missing_reason() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs CUDA: no GPU on this machine (run on a GPU node: pytest -m gpu)"
    return ""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE (4 layers, 8 experts, top-2) with its char-level tokenizer, made once."""
    from checkpoints.init_model import init_model

    return init_model(tmp_path_factory.mktemp("tiny_moe") / "model", arch="qwen3_moe", preset="tiny", seed=0)


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def preemption_signals_restored():
    """The preemption flag cleared and SIGTERM/SIGUSR1 handlers put back after a test that installs them."""
    import signal

    from checkpoints import preemption

    saved = {s: signal.getsignal(s) for s in preemption.DEFAULT_SIGNALS}
    preemption.clear()
    yield
    preemption.clear()
    for s, h in saved.items():
        signal.signal(s, h)
