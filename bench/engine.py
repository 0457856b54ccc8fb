"""Reference server tokens/s vs HF transformers `generate` on the same model and batch. `sao bench engine`.

Setup: the tiny (quick) or small Qwen3-MoE from checkpoints/init_model.py, 32 requests with mixed
prompt lengths and mixed output budgets (ignore_eos, so both sides produce exactly the budgets),
temperature 1. The server gets all 32 at once over HTTP (client in this process, server in a child
process, --max-batch 32); `generate` gets the same 32 prompts as one left-padded batch and must run
to the longest budget. Useful tokens = sum of the 32 budgets on both sides. After a warm-up the two
sides are timed alternately, 2 (quick) or 7 times each, and the medians are compared. ratio = server tokens/s / generate tokens/s (> 1: the server is faster). Both run
alternately on the same machine with one torch thread each. The spread is the interquartile range of
the per-repeat ratios (each server run over the generate run beside it).

Padding bound: `generate` decodes every row to the longest budget, N x max(budget) token slots for
sum(budgets) useful tokens; a server doing the same work per token without padding can gain at most
N x max(budget) / sum(budgets) over it. A measured ratio above that bound comes from something else
(scheduling, per-step overhead, a loaded machine slowing one side), not from continuous batching.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

NUM_REQUESTS = 32


def workload(quick: bool, vocab: int, seed: int = 0, context: int | None = None) -> list[tuple[list[int], int]]:
    """(prompt, max_new_tokens) per request: prompts 8-64 tokens, budgets 8-64 (quick) or 16-256, each
    capped so prompt + budget fits `context` (the server's --max-context, by default the model's
    max_position_embeddings): the server, as SGLang, refuses a request past it."""
    from rollout.context import fit_max_new_tokens

    rng = random.Random(seed)
    low, high = (8, 64) if quick else (16, 256)
    jobs = []
    for _ in range(NUM_REQUESTS):
        prompt = [rng.randrange(7, vocab) for _ in range(rng.randrange(8, 65))]
        budget = fit_max_new_tokens(len(prompt), len(prompt), rng.randrange(low, high + 1), context,
                                    field="max_position_embeddings")
        jobs.append((prompt, budget))
    return jobs


async def _server_run(url: str, api_key: str, jobs, warmup: bool) -> float:
    import aiohttp

    from rollout.engines.engine import GenerateRequest
    from rollout.engines.sglang_client import generate_body

    async def one(session, i, prompt, budget):
        body = generate_body(GenerateRequest(rid=f"b{i}-{time.monotonic_ns()}", input_ids=prompt,
                                             max_new_tokens=budget, seed=i, return_routed_experts=False))
        body["sampling_params"]["ignore_eos"] = True
        async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=1800)) as reply:
            data = await reply.json()
            if reply.status != 200 or len(data["output_ids"]) != budget:
                raise RuntimeError(f"bench request {i} failed: HTTP {reply.status} {str(data)[:300]}")

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"}) as session:
        if warmup:
            await one(session, -1, jobs[0][0], 4)
        start = time.perf_counter()
        await asyncio.gather(*(one(session, i, p, b) for i, (p, b) in enumerate(jobs)))
        return time.perf_counter() - start


def _hf_generate(model_dir: str, jobs):
    """A function that runs HF `generate` on the whole batch once and returns its seconds."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.config.pad_token_id or 0
    width = max(len(p) for p, _ in jobs)
    ids = torch.full((len(jobs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(jobs):          # left padding, as batched generation needs
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    longest = max(b for _, b in jobs)

    def generate(new_tokens, rows):
        with torch.no_grad():
            out = model.generate(input_ids=ids[:rows], attention_mask=mask[:rows], do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=pad)
        if out.shape[1] != width + new_tokens:
            raise RuntimeError(f"generate produced {out.shape[1] - width} tokens, expected {new_tokens}")

    generate(4, 2)                                                     # warm-up

    def timed() -> float:
        start = time.perf_counter()
        generate(longest, len(jobs))
        return time.perf_counter() - start
    return timed


def run(quick: bool = False, model_dir: str | None = None) -> dict:
    import torch

    from checkpoints.init_model import init_model
    from rollout.engines.reference_server import launch_local

    preset, repeats = ("tiny", 2) if quick else ("small", 7)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir or str(init_model(Path(tmp) / preset, preset=preset, seed=0))
        import transformers

        config = transformers.AutoConfig.from_pretrained(model_dir)
        jobs = workload(quick, config.vocab_size, context=config.max_position_embeddings)
        # one torch thread on each side: on a shared CPU box, OpenMP teams of 2+ threads stall
        # whenever a neighbour takes a core, which swung 2-thread timings 10x between runs
        threads = 1
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        server = launch_local(model_dir, api_key="bench", timeout_s=300,
                              extra_args=["--max-batch", str(NUM_REQUESTS), "--threads", str(threads)])
        server_times, hf_times = [], []
        try:
            hf_run = _hf_generate(model_dir, jobs)
            for i in range(repeats):   # interleaved, so a busy neighbour slows both sides alike
                server_times.append(asyncio.run(_server_run(server.url, "bench", jobs, warmup=i == 0)))
                hf_times.append(hf_run())
        finally:
            server.stop()
            torch.set_num_threads(previous_threads)
    server_s, hf_s = statistics.median(server_times), statistics.median(hf_times)
    useful = sum(b for _, b in jobs)
    server_tps, hf_tps = useful / server_s, useful / hf_s
    ratio = server_tps / hf_tps
    summary = (f"engine ({preset} model, {NUM_REQUESTS} requests, {useful} output tokens, {threads} threads): "
               f"reference server {server_tps:.0f} tok/s vs HF generate {hf_tps:.0f} tok/s -> ratio {ratio:.2f}x")
    return {"summary": summary, "model_preset": preset, "requests": NUM_REQUESTS, "useful_output_tokens": useful,
            "prompt_lengths": [len(p) for p, _ in jobs], "output_budgets": [b for _, b in jobs],
            "reference_server_s": server_times, "hf_generate_s": hf_times, "reference_server_tokens_per_s": server_tps,
            "hf_generate_tokens_per_s": hf_tps, "ratio": ratio, "torch_threads": threads,
            "ratio_per_repeat": per_repeat_ratios(server_times, hf_times),
            "padding_bound": padding_bound([b for _, b in jobs])}


def per_repeat_ratios(server_s: list[float], hf_s: list[float]) -> list[float]:
    """Each repeat's ratio: the generate run's seconds over the server run's beside it (same useful tokens)."""
    return [h / s for s, h in zip(server_s, hf_s)]


def padding_bound(budgets: list[int]) -> float:
    """The most a padding-free server could gain over padded batch generation: N x max / sum of budgets."""
    return len(budgets) * max(budgets) / sum(budgets)


def quartiles(values: list[float]) -> tuple[float, float]:
    """(25th, 75th) percentile, linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    def at(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = int(pos)
        return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)
    return at(0.25), at(0.75)


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=None, help="HF model dir (default: a fresh tiny/small Qwen3-MoE)")
    args = parser.parse_args()
    result = run(args.quick, args.model)
    print(result["summary"])
    print(json.dumps({k: v for k, v in result.items() if k != "summary"}, indent=1)[:2000])
