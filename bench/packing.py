"""Padded vs packed micro-batches on a long-tailed length mix: trained tokens/s side by side in one run.
`sao bench packing [--quick]`.

Setup: the tiny (quick) or small Qwen3-MoE trains with layout_check's policy-gradient loss on one rank.
The same samples (prompt 16 tokens, response lengths Pareto(1.2) x 40, capped; RL response lengths are
long-tailed) become micro-batches twice through the trainer's own batching (trainer/batching.py
pack_samples, token budget `budget`): right-padded rows (parallel.pack_sequences = false) and packed rows
(true). The two modes alternate step by step on the same model after one warm-up step each, so both see
the same machine state; tokens/s = real tokens of the step / seconds of train_step.
ratio = packed tokens/s / padded tokens/s (> 1: packing is faster). pad_fraction is perf/pad_fraction's.

Both modes attend within each sample (packed: THD, parallel/packed_attention.py on CPU, one attention call
per sample), so the gain is the padding's share of the GEMMs, minus the per-sample calls' overhead: on CPU
short, alike samples (little padding) train faster padded, which is why the CPU recipes keep padded rows.
"""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

MODES = ("padded", "packed")


def long_tailed_samples(n: int, max_response: int, seed: int = 0) -> list:
    """Samples whose response lengths follow Pareto(1.2) x 40, capped at `max_response` (prompt: 16 tokens)."""
    from sao_megatron.core.records import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = max(1, min(int(rng.paretovariate(1.2) * 40), max_response))
        response = [rng.randrange(7, 100) for _ in range(length)]
        out.append(Sample(uid=f"b{i}", prompt_index=i, prompt_ids=[rng.randrange(7, 100) for _ in range(16)],
                          response_ids=response, loss_mask=[1] * length, rollout_logprobs=[0.0] * length,
                          weight_versions=[0] * length))
    return out


def _batches(samples: list, budget: int, packed: bool) -> list:
    import torch

    from sao_megatron.trainer.batching import pack_samples

    batches = pack_samples(samples, budget, with_routes=False, packed=packed).batches
    gen = torch.Generator().manual_seed(1)
    return [replace(b, advantages=torch.randn(b.loss_mask.shape, generator=gen) * b.loss_mask) for b in batches]


def _measure(model_dir: str, n: int, max_response: int, budget: int, steps: int) -> dict:
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.rl_model import RLModel
    from sao_megatron.trainer.speed import pad_fraction

    samples = long_tailed_samples(n, max_response)
    tokens = sum(s.num_tokens for s in samples)
    batches = {mode: _batches(samples, budget, mode == "packed") for mode in MODES}
    model = RLModel.build(lc.make_recipe(model_dir, {}, lr=1e-5, micro_batch_tokens=budget), "policy")
    model.load_hf_state_dict(load_file(f"{model_dir}/model.safetensors"))
    seconds = {mode: [] for mode in MODES}
    losses = {}
    for step in range(steps + 1):          # step 0: warm-up of each mode, not timed
        for mode in MODES:
            started = time.perf_counter()
            metrics = model.train_step(batches[mode], lc.policy_gradient_loss)
            if step:
                seconds[mode].append(time.perf_counter() - started)
            losses.setdefault(mode, metrics["loss"])
    return {"tokens_per_step": tokens, "lengths": [s.num_tokens for s in samples],
            "modes": {mode: {"micro_batches": len(batches[mode]), "pad_fraction": pad_fraction(batches[mode]),
                             "computed_slots": sum(int(b.lengths.sum()) if b.packed else int(b.tokens.numel())
                                                   for b in batches[mode]),
                             "seconds_per_step": seconds[mode], "first_loss": losses[mode],
                             "tokens_per_s": tokens / statistics.fmean(seconds[mode])} for mode in MODES}}


def run(quick: bool = False, out_dir: Optional[Path] = None) -> dict:
    from checkpoints.init_model import init_model
    from parallel.distributed import run_distributed_test

    preset, n, max_response, budget, steps = ("tiny", 16, 192, 768, 1) if quick else ("small", 48, 768, 2048, 3)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(init_model(Path(tmp) / preset, arch="qwen3_moe", preset=preset, seed=0))
        measured = run_distributed_test(_measure, world_size=1, timeout_s=1800,
                                        args=(model_dir, n, max_response, budget, steps))[0]
    modes = measured["modes"]
    result = {"preset": preset, "samples": n, "max_response": max_response, "budget": budget, "timed_steps": steps,
              "tokens_per_step": measured["tokens_per_step"], "lengths": measured["lengths"], "modes": modes,
              "ratio_packed_vs_padded": modes["packed"]["tokens_per_s"] / modes["padded"]["tokens_per_s"]}
    result["summary"] = _summary(result)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        _plot(result, Path(out_dir) / "packing.png")
    return result


def _summary(r: dict) -> str:
    lines = [f"model {r['preset']}, {r['samples']} samples ({r['tokens_per_step']} tokens/step, long-tailed), "
             f"budget {r['budget']} tokens, {r['timed_steps']} timed steps per mode (+1 warm-up)",
             f"{'mode':>7} {'micro-b.':>8} {'pad frac':>8} {'slots':>7} {'tokens/s':>9}"]
    for mode, m in r["modes"].items():
        lines.append(f"{mode:>7} {m['micro_batches']:8d} {m['pad_fraction']:8.3f} {m['computed_slots']:7d} "
                     f"{m['tokens_per_s']:9.1f}")
    lines.append(f"packed / padded tokens/s: {r['ratio_packed_vs_padded']:.2f}")
    return "\n".join(lines)


def _plot(r: dict, path: Path) -> None:
    """Left: the length mix; right: tokens/s per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    left.hist(r["lengths"], bins=30)
    left.set_xlabel("sample tokens")
    left.set_ylabel("samples")
    left.set_title("length mix")
    names = list(r["modes"])
    right.bar(names, [r["modes"][m]["tokens_per_s"] for m in names])
    right.set_ylabel("trained tokens/s")
    right.set_title(f"packed / padded = {r['ratio_packed_vs_padded']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def section(r: dict, link) -> str:
    """The docs/results.md section (bench/registry.py)."""
    from bench.report_format import md_table

    rows = [[mode, m["micro_batches"], f"{m['pad_fraction']:.3f}", m["computed_slots"], f"{m['tokens_per_s']:.1f}"]
            for mode, m in r["modes"].items()]
    out = [f"Model preset `{r['preset']}`, {r['samples']} samples with long-tailed lengths ({r['tokens_per_step']} "
           f"real tokens per step, responses up to {r['max_response']}), token budget {r['budget']}; the two modes "
           f"alternate step by step on one rank. **packed / padded tokens/s = {r['ratio_packed_vs_padded']:.2f}**.",
           md_table(["mode", "micro-batches", "pad fraction", "computed slots", "trained tokens/s"], rows),
           link("packing.png", "length mix and tokens/s")]
    if not (r.get("machine") or {}).get("accelerator"):
        out.append("Measured on CPU: packed attention is one call per sample there (parallel/packed_attention.py), "
                   "Transformer Engine's THD kernel on a GPU is one call per micro-batch, so the GPU ratio is not "
                   "this one.")
    return "\n\n".join(out)
