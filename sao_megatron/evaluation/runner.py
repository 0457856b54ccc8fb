"""Held-out evaluation: k samples per problem from the engines, scored, summarised as avg@k / pass@k.

Used on `eval.interval` during training (with the engines' current weights) and by `sao eval`.
Answer checking: the task's own checker for built-in tasks, math-verify for dataset files
(AIME / BeyondAIME / IMO-AnswerBench-style jsonl with `prompt` and `answer`).
Agentic benchmarks plug in as an `AgenticEval` (an environment that scores a whole episode),
named in eval.datasets as 'SCHEME:ARG' with SCHEME registered in AGENTIC_EVALS or, from a recipe,
in eval.agentic_evals = {SCHEME = 'pkg.mod:Class'}.
Sampling: eval.temperature / eval.top_p / eval.max_new_tokens, each falling back to rollout's.
Prompts get the rollout's chat-template options (system prompt, enable_thinking, template kwargs),
so a held-out prompt reads as a training prompt does.
"""
from __future__ import annotations

import abc
import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rollout.context import PromptTooLong, fit_max_new_tokens
from rollout.engines.engine import Generator, GenerateRequest
from sao_megatron.core.config.errors import ConfigError
from sao_megatron.core.records import Sample
from sao_megatron.core.imports import resolve_import_path

from .scores import summarize

log = logging.getLogger(__name__)

# eval.datasets scheme -> 'module:class' of an AgenticEval with
# from_source(arg, eval_cfg, rollout_cfg, context_length=None).
AGENTIC_EVALS = {"code_repair": "sao_megatron.evaluation.code_repair:CodeRepairEval",
                 "tool_task": "sao_megatron.evaluation.tool_task:ToolTaskEval"}


@dataclass
class EpisodeResult:
    """One agentic episode. `error` says why an environment failure (not a wrong answer) scored it 0."""

    score: float
    error: str = ""
    info: dict = field(default_factory=dict)


class AgenticEval(abc.ABC):
    """An environment-style benchmark (e.g. SWE-bench-like): runs one episode, scores it in [0, 1].

    A failure of one task (bad row, sandbox limit, malformed patch) is an EpisodeResult with score 0
    and its `error`; an exception escaping run_episode is recorded the same way by the runner.
    """

    name: str

    @abc.abstractmethod
    async def run_episode(self, engine: Generator, tokenizer, problem, seed: int) -> EpisodeResult: ...

    @abc.abstractmethod
    def problems(self) -> list: ...


def agentic_evals(eval_cfg) -> dict:
    """Scheme -> 'module:Class': the built-in ones and the recipe's eval.agentic_evals."""
    return {**AGENTIC_EVALS, **(getattr(eval_cfg, "agentic_evals", None) or {})}


def eval_sampling(eval_cfg, rollout_cfg) -> tuple[float, float, int]:
    """(temperature, top_p, max_new_tokens) of evaluation: eval's own, else rollout's."""
    pick = lambda name: getattr(eval_cfg, name, None) if getattr(eval_cfg, name, None) is not None \
        else getattr(rollout_cfg, name)   # noqa: E731
    return float(pick("temperature")), float(pick("top_p")), int(pick("max_new_tokens"))


def agentic_eval_for(source: str, eval_cfg, rollout_cfg, context_length: Optional[int] = None) -> Optional[AgenticEval]:
    """The AgenticEval a 'SCHEME:ARG' source names, or None for a dataset file or 'task:NAME'."""
    scheme, sep, arg = source.partition(":")
    if not sep or scheme == "task":
        return None
    known = agentic_evals(eval_cfg)
    if scheme not in known:
        raise ConfigError("eval.datasets", f"unknown source scheme {scheme!r} in {source!r}",
                          f"use one of {', '.join(['task'] + sorted(known))}, or a file path without ':'")
    return resolve_import_path(known[scheme], "eval.datasets").from_source(
        arg, eval_cfg, rollout_cfg, context_length=context_length)


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


async def evaluate_source(engines: list[Generator], tokenizer, source: str, *, k: int, temperature: float,
                          max_new_tokens: int, seed: int = 0, limit: int = 0, concurrency: int = 32,
                          context_length: Optional[int] = None, top_p: float = 1.0, template=None) -> dict:
    """avg@k / pass@k of k samples per row. max_new_tokens is capped so prompt + response fits
    ``context_length`` (rollout/context.py); a prompt that alone does not fit scores 0 and is counted
    in ``errors`` (present only when some were), with one warning line each."""
    rows = load_eval_rows(source, seed, limit)
    score = scorer_for(source)
    limiter = asyncio.Semaphore(concurrency)
    engine_cycle = itertools.cycle(engines)
    too_long: list[str] = []

    async def one(problem_index: int, sample_index: int, row) -> float:
        prompt_ids = encode_prompt(tokenizer, row.prompt, template)
        try:
            budget = fit_max_new_tokens(len(prompt_ids), len(prompt_ids), max_new_tokens, context_length)
        except PromptTooLong as exc:
            if sample_index == 0:
                log.warning("eval %s problem %d scored 0: %s", source, problem_index, exc)
            too_long.append(str(exc))
            return 0.0
        request = GenerateRequest(rid=f"eval-{problem_index}-{sample_index}-{seed}", input_ids=prompt_ids,
                                  max_new_tokens=budget, temperature=temperature, top_p=top_p,
                                  seed=seed * 1_000_003 + problem_index * 1009 + sample_index,
                                  stop_token_ids=[tokenizer.eos_token_id], return_routed_experts=False)
        async with limiter:
            result = await next(engine_cycle).generate(request)
        text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
        return float(await asyncio.to_thread(score, text, row.label))

    tasks = [[one(p, j, row) for j in range(k)] for p, row in enumerate(rows)]
    correct = [list(await asyncio.gather(*per_problem)) for per_problem in tasks]
    out = summarize(correct, _reported_ks(k))
    if out and too_long:
        out["errors"] = float(len(too_long))
    return out


async def evaluate_agentic(engines: list[Generator], tokenizer, env: AgenticEval, *, k: int, seed: int = 0,
                           limit: int = 0, concurrency: int = 8, episodes: Optional[list] = None) -> dict:
    """avg@k / pass@k over k episodes per problem, plus `errors` (episodes an environment failure ended).

    Per-episode records (problem, sample, score, error, info) are appended to `episodes` if given.
    """
    problems = env.problems()
    problems = problems[:limit] if limit else problems
    limiter = asyncio.Semaphore(concurrency)
    engine_cycle = itertools.cycle(engines)

    async def one(problem_index: int, sample_index: int, problem) -> EpisodeResult:
        async with limiter:
            try:
                return await env.run_episode(next(engine_cycle), tokenizer, problem,
                                             seed=seed * 1_000_003 + problem_index * 1009 + sample_index)
            except Exception as exc:  # one task's failure scores 0 with its reason; it never stops the eval
                return EpisodeResult(0.0, error=f"{type(exc).__name__}: {exc}")

    flat = await asyncio.gather(*(one(p, j, problem) for p, problem in enumerate(problems) for j in range(k)))
    results = [list(flat[p * k:(p + 1) * k]) for p in range(len(problems))]
    for p, row in enumerate(results):
        for j, result in enumerate(row):
            if result.error:
                log.warning("eval %s problem %d sample %d scored 0: %s", env.name, p, j, result.error)
            if episodes is not None:
                episodes.append({"set": env.name, "problem": p, "sample": j, "score": result.score,
                                 "error": result.error, **result.info})
    out = summarize([[r.score for r in row] for row in results], _reported_ks(k))
    if out:
        out["errors"] = float(sum(1 for row in results for r in row if r.error))
    return out


async def evaluate_all(engines, tokenizer, eval_cfg, rollout_cfg, seed: int = 0,
                       episodes: Optional[list] = None, context_length: Optional[int] = None) -> dict:
    """eval/<set>/avg@k and eval/<set>/pass@k for every configured set (agentic sets fill `episodes`);
    ``context_length`` (model.max_seq_len) bounds every request's prompt + response."""
    out = {}
    for source in eval_cfg.datasets:
        env = agentic_eval_for(source, eval_cfg, rollout_cfg, context_length)
        if env is not None:
            name = env.name
            result = await evaluate_agentic(engines, tokenizer, env, k=eval_cfg.k, seed=seed,
                                            limit=eval_cfg.max_problems, episodes=episodes)
        else:
            name = source[5:] if source.startswith("task:") else Path(source).stem
            temperature, top_p, max_new_tokens = eval_sampling(eval_cfg, rollout_cfg)
            result = await evaluate_source(engines, tokenizer, source, k=eval_cfg.k, temperature=temperature,
                                           top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
                                           limit=eval_cfg.max_problems, context_length=context_length,
                                           template=rollout_cfg)
        out.update({f"eval/{name}/{key}": value for key, value in result.items()})
    return out


def _reported_ks(k: int) -> list[int]:
    return sorted({1, k} | ({16} if k >= 16 else set()))


def encode_prompt(tokenizer, prompt, template=None) -> list[int]:
    """Prompt ids through the chat template; `template` (a rollout section) adds its system prompt and
    template kwargs (rollout/prompts.py), as training prompts get them."""
    from rollout.prompts import template_kwargs

    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    system = getattr(template, "system_prompt", "") if template is not None else ""
    if system and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system}] + list(messages)
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False, **template_kwargs(template)))
    return tokenizer.encode(prompt if isinstance(prompt, str) else messages[-1]["content"])


def engine_turn(engine: Generator, seed: int, temperature: float, context_length: Optional[int] = None):
    """The agent's turn function: one generate call on `engine`, appended as action tokens. The
    budget is capped to the context (a full one ends the turn as `length` without a call); a prompt
    that alone does not fit raises PromptTooLong, which scores the episode 0 with that reason."""
    async def turn(sample: Sample, max_new_tokens: int, stop_ids: list[int]) -> str:
        n = sample.metadata.get("turns", 0)
        max_new_tokens = fit_max_new_tokens(len(sample.prompt_ids), sample.num_tokens, max_new_tokens, context_length)
        if max_new_tokens <= 0:
            return "length"
        request = GenerateRequest(rid=f"{sample.uid}-t{n}", input_ids=sample.prompt_ids + sample.response_ids,
                                  max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + 7919 * n,
                                  stop_token_ids=stop_ids, return_routed_experts=False)
        result = await engine.generate(request)
        count = len(result.output_ids)
        sample.response_ids += result.output_ids
        sample.loss_mask += [1] * count
        sample.rollout_logprobs += list(result.output_logprobs or [0.0] * count)
        sample.weight_versions += list(result.output_weight_versions or [result.weight_version] * count)
        return "stop" if result.finish_reason == "stop" else "length"
    return turn
