"""The GPU check kit's speed probe (tests/gpu/test_speed_probe.py; not among the kit's REQUIRED checks):
the trainer's train tokens/s and TFLOP/s against a plain HF transformers training step on the same MoE,
the same samples, one device, side by side in one run.

- trainer: RLModel policy (Transformer Engine on a GPU: grouped GEMM, fusions, packed THD micro-batches,
  parallel/fusions.py), layout_check's policy-gradient loss, one optimizer step per step;
- HF: AutoModelForCausalLM in the same dtype, right-padded micro-batches of the same token budget,
  token-mean cross-entropy over the response, torch AdamW; one optimizer step per step.
tokens/s = real tokens (prompt + response) of the step / seconds of the step after one warm-up step;
TFLOP/s = the planner's FLOP model (trainer/speed.py forward_flops; a training step = 3 forward passes)
/ seconds: the same FLOP count for both sides, so the TFLOP/s ratio is the tokens/s ratio.

`MID` is the mid-size MoE the kit trains: Qwen3-MoE shape, 8 layers, hidden 1024, 32 experts top-4.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

MID = dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=8,
           num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
           max_position_embeddings=4096, vocab_size=32000)


def make_model(out_dir: Path, shape: dict = MID, dtype: str = "bf16") -> Path:
    """A random-weight Qwen3-MoE of `shape` saved as an HF checkpoint (no tokenizer needed)."""
    import torch

    from checkpoints.tiny_models import build_tiny_model

    model = build_tiny_model("qwen3_moe", 0, "small", **shape)
    model.to(torch.bfloat16 if dtype == "bf16" else torch.float32).save_pretrained(out_dir)
    return Path(out_dir)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(step, steps: int) -> list[float]:
    """Seconds of `steps` calls of step() after one untimed warm-up call."""
    step()
    seconds = []
    for _ in range(steps):
        _sync()
        started = time.perf_counter()
        step()
        _sync()
        seconds.append(time.perf_counter() - started)
    return seconds


def trainer_seconds(model_dir: str, samples: list, budget: int, steps: int, dtype: str) -> list[float]:
    """Per-step seconds of the trainer (run inside a rank: run_distributed_test)."""
    import torch
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.rl_model import RLModel
    from sao_megatron.trainer.batching import pack_samples

    recipe = lc.make_recipe(model_dir, {}, lr=1e-6, micro_batch_tokens=budget)
    recipe.model.dtype = dtype
    model = RLModel.build(recipe, "policy")
    model.load_hf_state_dict(load_file(f"{model_dir}/model.safetensors"))
    batches = pack_samples(samples, budget, with_routes=False, packed=recipe.parallel.pack_sequences).batches
    gen = torch.Generator().manual_seed(0)
    batches = [replace(b, advantages=torch.randn(b.loss_mask.shape, generator=gen) * b.loss_mask) for b in batches]
    return _timed(lambda: model.train_step(batches, lc.policy_gradient_loss), steps)


def hf_seconds(model_dir: str, samples: list, budget: int, steps: int, dtype: str) -> list[float]:
    """Per-step seconds of a plain transformers training step on the same samples (padded micro-batches)."""
    import torch
    import transformers

    from sao_megatron.trainer.batching import pack_samples

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batches = [(b.tokens.to(device), b.loss_mask.to(device), b.lengths.to(device))
               for b in pack_samples(samples, budget, with_routes=False).batches]

    def step():
        for tokens, mask, lengths in batches:
            attention = (torch.arange(tokens.shape[1], device=device) < lengths.unsqueeze(1)).long()
            logits = model(input_ids=tokens, attention_mask=attention).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
            loss = -(logp * mask[:, 1:]).sum() / mask.sum().clamp(min=1)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _timed(step, steps)


def _rank(model_dir: str, samples: list, budget: int, steps: int, dtype: str) -> dict:
    return {"trainer": trainer_seconds(model_dir, samples, budget, steps, dtype)}


def measure(model_dir: str, steps: int = 3, dtype: str = "bf16", n: int = 64, max_response: int = 1536,
            budget: int = 8192) -> dict:
    """Both sides on the same long-tailed samples (bench/packing.py's mix); the kit's speed-probe record."""
    import json

    import torch

    from bench.packing import long_tailed_samples
    from parallel.distributed import run_distributed_test
    from sao_megatron.trainer.speed import SpeedMeter

    samples = long_tailed_samples(n, max_response)
    tokens = sum(s.num_tokens for s in samples)
    flops = 3 * SpeedMeter(json.loads((Path(model_dir) / "config.json").read_text()), 1).forward_flops(samples)
    seconds = run_distributed_test(_rank, world_size=1, timeout_s=1800,
                                   args=(model_dir, samples, budget, steps, dtype))[0]
    seconds["hf"] = hf_seconds(model_dir, samples, budget, steps, dtype)
    out = {"model": str(model_dir), "dtype": dtype, "samples": n, "tokens_per_step": tokens, "budget": budget,
           "timed_steps": steps, "flops_per_step": flops,
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for side in ("trainer", "hf"):
        mean = statistics.fmean(seconds[side])
        out[side] = {"seconds_per_step": seconds[side], "tokens_per_s": tokens / mean, "tflops": flops / mean / 1e12}
    out["trainer_vs_hf_tokens_per_s"] = out["trainer"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
    return out
