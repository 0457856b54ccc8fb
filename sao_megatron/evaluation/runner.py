"""Held-out evaluation: k samples per problem from the engines, scored, summarised as avg@k / pass@k.

Used on `eval.interval` during training (with the engines' current weights) and by `sao eval`.
Answer checking: the task's own checker for built-in tasks, math-verify for dataset files
(AIME / BeyondAIME / IMO-AnswerBench-style jsonl with `prompt` and `answer`).
Agentic benchmarks plug in as an `AgenticEval` (an environment that scores a whole episode).
"""
from __future__ import annotations

import abc
import asyncio
import itertools
from pathlib import Path

from rollout.engine import Engine, GenerateRequest

from .scores import summarize


class AgenticEval(abc.ABC):
    """An environment-style benchmark (e.g. SWE-bench-like): runs one episode, returns its score in [0, 1]."""

    name: str

    @abc.abstractmethod
    async def run_episode(self, engine: Engine, tokenizer, problem, seed: int) -> float: ...

    @abc.abstractmethod
    def problems(self) -> list: ...


def load_eval_rows(source: str, seed: int, limit: int):
    """A jsonl/parquet file, or 'task:NAME' for a generated held-out set of a built-in task."""
    from rollout.prompts import load_rows, task_rows

    if source.startswith("task:"):
        rows = task_rows(source[5:], seed=10_000 + seed, num_problems=limit or 64)
    else:
        rows = load_rows(source, bad_row="skip")
    return rows[:limit] if limit else rows


def scorer_for(source: str):
    """(response_text, label) -> score: the built-in task's checker, else math-verify."""
    if source.startswith("task:"):
        from rollout.rewards.tasks import get_task

        task = get_task(source[5:])
        return task.score
    from rollout.rewards.math import verify_answer

    return verify_answer


async def evaluate_source(engines: list[Engine], tokenizer, source: str, *, k: int, temperature: float,
                          max_new_tokens: int, seed: int = 0, limit: int = 0, concurrency: int = 32) -> dict:
    rows = load_eval_rows(source, seed, limit)
    score = scorer_for(source)
    limiter = asyncio.Semaphore(concurrency)
    engine_cycle = itertools.cycle(engines)

    async def one(problem_index: int, sample_index: int, row) -> float:
        prompt_ids = _encode(tokenizer, row.prompt)
        request = GenerateRequest(rid=f"eval-{problem_index}-{sample_index}-{seed}", input_ids=prompt_ids,
                                  max_new_tokens=max_new_tokens, temperature=temperature,
                                  seed=seed * 1_000_003 + problem_index * 1009 + sample_index,
                                  stop_token_ids=[tokenizer.eos_token_id], return_routed_experts=False)
        async with limiter:
            result = await next(engine_cycle).generate(request)
        text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
        return float(await asyncio.to_thread(score, text, row.label))

    tasks = [[one(p, j, row) for j in range(k)] for p, row in enumerate(rows)]
    correct = [list(await asyncio.gather(*per_problem)) for per_problem in tasks]
    ks = sorted({1, k} | ({16} if k >= 16 else set()))
    return summarize(correct, ks)


async def evaluate_all(engines, tokenizer, eval_cfg, rollout_cfg, seed: int = 0) -> dict:
    """eval/<set>/avg@k and eval/<set>/pass@k for every configured set."""
    out = {}
    for source in eval_cfg.datasets:
        name = source[5:] if source.startswith("task:") else Path(source).stem
        result = await evaluate_source(engines, tokenizer, source, k=eval_cfg.k, temperature=rollout_cfg.temperature,
                                       max_new_tokens=rollout_cfg.max_new_tokens, seed=seed,
                                       limit=eval_cfg.max_problems)
        out.update({f"eval/{name}/{key}": value for key, value in result.items()})
    return out


def _encode(tokenizer, prompt) -> list[int]:
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return tokenizer.encode(prompt if isinstance(prompt, str) else messages[-1]["content"])
