"""Trainer step time per token under TP2 and EP2 vs one rank. `sao bench parallel [--quick]`.

Setup: the tiny Qwen3-MoE (checkpoints/init_model.py, preset tiny or small) trains with the fixed
policy-gradient loss of parallel/layout_check.py on fixed micro-batches. The single-rank reference
and the 2-rank layouts run back to back in this run on the same data; seconds per step are averaged
over `steps` steps after one warm-up step, divided by the tokens of a step.
ratio = (s/token of layout) / (s/token of one rank): < 1 means the layout is faster. On a CPU box
both ranks share the same cores, so the ratio measures parallel overhead (collectives, SP gathers,
all-to-all), not the speed-up a GPU node gives.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

LAYOUTS = ["tp2", "ep2"]


def _timed(model_dir: str, names: list[str], steps: int, num: int, seq: int) -> dict:
    from parallel import layout_check as lc

    results = lc.run_layouts(model_dir, names, steps=steps + 1, num_batches=num, seq=seq)
    return {n: r["seconds_per_step"] for n, r in results.items()}


def run(quick: bool = False) -> dict:
    from checkpoints.init_model import init_model
    from parallel.distributed import run_distributed_test

    preset, steps, num, seq = ("tiny", 2, 4, 32) if quick else ("small", 5, 8, 128)
    rows = 2
    tokens = rows * seq * num
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(init_model(Path(tmp) / preset, arch="qwen3_moe", preset=preset, seed=0))
        single = run_distributed_test(_timed, world_size=1, timeout_s=900, args=(model_dir, ["single"], steps, num, seq))[0]
        layouts = run_distributed_test(_timed, world_size=2, timeout_s=900, args=(model_dir, LAYOUTS, steps, num, seq))[0]
    base = single["single"] / tokens
    per_token = {name: layouts[name] / tokens for name in LAYOUTS}
    ratios = {name: per_token[name] / base for name in LAYOUTS}
    lines = [f"model {preset}, {tokens} tokens/step, {steps} timed steps (+1 warm-up); ratio = s/token vs 1 rank"]
    lines.append(f"{'layout':>8} {'ms/step':>9} {'us/token':>9} {'ratio':>7}")
    lines.append(f"{'1 rank':>8} {single['single'] * 1e3:9.1f} {base * 1e6:9.2f} {1.0:7.2f}")
    for name in LAYOUTS:
        lines.append(f"{name:>8} {layouts[name] * 1e3:9.1f} {per_token[name] * 1e6:9.2f} {ratios[name]:7.2f}")
    return {"preset": preset, "tokens_per_step": tokens, "seconds_per_step": {"single": single["single"], **layouts},
            "seconds_per_token": {"single": base, **per_token}, "ratio_vs_single": ratios, "summary": "\n".join(lines)}
