"""`sao doctor`: print the environment, then run the tiny MoE under each parallel layout that fits
the local world and print, per layout, max |delta| of logprobs, loss and grad norm against one rank.

Layouts run inside one process group (parallel/layout_check.py); the reference is a separate
single-rank run on the same weights and micro-batches. Exit 1 if a layout is out of tolerance.
"""
from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

# fp32 on CPU; TP/EP/DP change reduction order (tests/distributed/test_parallel_layouts.py).
TOLERANCE = {"logp": 2e-6, "loss": 1e-6, "grad_norm_rel": 1e-5}


# What Megatron-Core's import-time warnings mean (sao train hides them: sao_megatron/metrics/console.py).
MISSING_KERNELS_NOTE = (
    "note: without Transformer Engine (and Apex) Megatron-Core warns 'Transformer Engine and Apex are not installed. "
    "Falling back to ...' once per module: it then runs its local PyTorch layers, norms, optimizer and grad-clip "
    "kernels. That is the CPU path and is numerically fine; on GPUs it is slower (no fused kernels, no FP8), so "
    "install transformer-engine there. `sao train` hides these warnings.")


def register(sub) -> None:
    parser = sub.add_parser("doctor", help="Check the environment and parallel layouts against a single rank")
    parser.add_argument("--world-size", type=int, default=2, choices=[1, 2, 4],
                        help="ranks to spawn for the layout check (1 = environment only)")
    parser.add_argument("--model", default="", help="HF model directory (default: a fresh tiny Qwen3-MoE)")
    parser.add_argument("--layouts", default="", help="comma-separated subset of the layouts that fit")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per layout")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before stuck ranks are killed")
    parser.set_defaults(func=run)


def environment() -> dict[str, str]:
    """Versions of the stack, 'missing' where a package is not importable."""
    import torch

    info = {"torch": torch.__version__,
            "cuda": torch.version.cuda if torch.cuda.is_available() else f"not available (build: {torch.version.cuda})",
            "gpus": str(torch.cuda.device_count()) if torch.cuda.is_available() else "0"}
    for name, module in (("megatron-core", "megatron.core"), ("transformer_engine", "transformer_engine"),
                         ("sglang", "sglang"), ("transformers", "transformers")):
        try:
            info[name] = getattr(importlib.import_module(module), "__version__", "installed")
        except Exception as err:  # an optional package may be missing or fail to import without CUDA
            info[name] = f"missing ({type(err).__name__})"
    return info


def check_layouts(model_dir: str, world_size: int, names: list[str], steps: int, timeout: float) -> dict:
    from parallel import layout_check as lc
    from parallel.distributed import run_distributed_test

    ref = run_distributed_test(lc.run_layouts, world_size=1, timeout_s=timeout,
                               args=(model_dir, ["single"], steps))[0]["single"]
    results = run_distributed_test(lc.run_layouts, world_size=world_size, timeout_s=timeout,
                                   args=(model_dir, names, steps))[0]
    return {name: (lc.compare(res, ref), max(s["grad_norm"] for s in ref["steps"])) for name, res in results.items()}


def within(delta: dict, grad_scale: float) -> bool:
    return (delta["logp"] <= TOLERANCE["logp"] and delta["loss"] <= TOLERANCE["loss"]
            and delta["grad_norm"] <= TOLERANCE["grad_norm_rel"] * grad_scale)


def run(args) -> int:
    info = environment()
    for key, value in info.items():
        print(f"{key:>20}: {value}")
    if info["transformer_engine"].startswith("missing"):
        print(MISSING_KERNELS_NOTE)
    if args.world_size == 1:
        return 0
    from parallel.layout_check import check_fit, layouts_for_world
    from sao_megatron.core.dims import LayoutError

    fits = layouts_for_world(args.world_size)
    names = [n for n in args.layouts.split(",") if n] or fits
    unknown = [n for n in names if n not in fits]
    if unknown:
        print(f"sao doctor: layouts {unknown} do not fit {args.world_size} ranks; use some of {fits}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or _tiny_model(Path(tmp))
        try:
            check_fit(model_dir, names, args.world_size)
        except LayoutError as err:
            print(f"sao doctor: {err}", file=sys.stderr)
            return 2
        table = check_layouts(model_dir, args.world_size, names, args.steps, args.timeout)
    print(f"\nlayouts on {args.world_size} ranks vs 1 rank ({args.steps} steps):")
    print(f"{'layout':>14} {'max|dlogp|':>12} {'max|dloss|':>12} {'max|dgradnorm|':>15}  ok")
    bad = 0
    for name, (delta, scale) in table.items():
        ok = within(delta, scale)
        bad += not ok
        print(f"{name:>14} {delta['logp']:12.3e} {delta['loss']:12.3e} {delta['grad_norm']:15.3e}  {'yes' if ok else 'NO'}")
    return 1 if bad else 0


def _tiny_model(tmp: Path) -> str:
    from checkpoints.init_model import init_model

    return str(init_model(tmp / "tiny", arch="qwen3_moe", preset="tiny", seed=0))
