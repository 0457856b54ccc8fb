"""Held-out evaluation of the python-tool agent on a built-in task: `eval.datasets = ['tool_task:TASK']`.

The training episodes of rollout.agent = 'python_tool' (rollout/agents/tool_loop.py) are whole tool
conversations, so a plain `task:NAME` set, which scores one generation per problem, does not measure
that agent. This set runs each problem as an episode of the same agent: the prompt through the
rollout's chat template (system prompt and template options included), up to eval.max_turns model
turns of eval.max_new_tokens (else rollout.max_new_tokens), eval.max_episode_tokens for actions and
tool outputs together, python calls in the rollout's sandbox (rollout.sandbox). The submitted answer,
else the action text, is scored by the task's checker, as rollout/rewards/task_reward.py scores a
training episode.

Problems: the distinct problems of TASK drawn from a fixed seed, up to eval.max_problems (64 when 0).
Name a held-out side, e.g. `tool_task:chain:1:1:eval` while training on `chain:1:1:train`, and the
eval never sees a training prompt (rollout/rewards/tasks.py, heldout_split). Reported as
eval/tool_task-TASK/avg@k and pass@k (':' in TASK read as '-').
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from rollout.agents.tool_loop import ToolAgent, observation_budget
from rollout.engines.engine import Generator
from rollout.rewards.sandbox import SandboxLimits
from sao_megatron.core.config.errors import ConfigError
from sao_megatron.core.records import Sample

from .runner import AgenticEval, EpisodeResult, encode_prompt, engine_turn

PROBLEM_SEED = 10_000      # the draw of the problems; the training prompts' seed is the run's own
DEFAULT_PROBLEMS = 64
DRAWS_PER_PROBLEM = 50     # a small task (chain:1:1:eval has 30 problems) stops at what it has


@dataclass
class ToolTaskEval(AgenticEval):
    """eval/tool_task-TASK/avg@k and pass@k: the python-tool agent's episodes on TASK's problems."""

    task: str
    max_problems: int = DEFAULT_PROBLEMS
    max_turns: int = 3
    max_turn_tokens: int = 64
    max_episode_tokens: int = 256
    temperature: float = 1.0
    template: object = None                  # the rollout section: system prompt, chat-template options
    sandbox_limits: SandboxLimits = SandboxLimits(wall_time_s=5)
    context_length: Optional[int] = None     # model.max_seq_len: prompt + episode never passes it
    rows: list = field(init=False)

    def __post_init__(self):
        from rollout.prompts import task_rows
        from sao_megatron.core.config.installed import check_task

        try:
            check_task("eval.datasets", self.task)
        except ConfigError as exc:
            raise ConfigError("eval.datasets", f"tool_task:{self.task}: {exc.problem}", exc.fix) from exc
        self.name = "tool_task-" + self.task.replace(":", "-")
        wanted = self.max_problems or DEFAULT_PROBLEMS
        seen, self.rows = set(), []
        for row in task_rows(self.task, seed=PROBLEM_SEED, num_problems=wanted * DRAWS_PER_PROBLEM):
            if row.prompt not in seen:
                seen.add(row.prompt)
                self.rows.append(row)
            if len(self.rows) == wanted:
                break

    @classmethod
    def from_source(cls, arg: str, eval_cfg, rollout_cfg, context_length: Optional[int] = None) -> "ToolTaskEval":
        from rollout.rewards.sandbox_bwrap import require_bwrap

        from .runner import eval_sampling

        isolation = getattr(rollout_cfg, "sandbox", "bwrap")
        if isolation == "bwrap":       # one line before the eval, not a failed episode per problem
            require_bwrap()
        temperature, _, max_new_tokens = eval_sampling(eval_cfg, rollout_cfg)
        return cls(arg, max_problems=eval_cfg.max_problems, max_turns=eval_cfg.max_turns,
                   max_turn_tokens=max_new_tokens, max_episode_tokens=eval_cfg.max_episode_tokens,
                   temperature=temperature, template=rollout_cfg, context_length=context_length,
                   sandbox_limits=dataclasses.replace(cls.sandbox_limits, isolation=isolation))

    def problems(self) -> list:
        return list(self.rows)

    async def run_episode(self, engine: Generator, tokenizer, problem, seed: int) -> EpisodeResult:
        from rollout.rewards.tasks import get_task

        sample = Sample(uid=f"{self.name}-{problem.line}-{seed}", prompt_index=problem.line,
                        prompt_ids=encode_prompt(tokenizer, problem.prompt, self.template))
        agent = ToolAgent(tokenizer, max_turns=self.max_turns, max_total_tokens=self.max_episode_tokens,
                          max_turn_tokens=self.max_turn_tokens,
                          max_observation_tokens=observation_budget(self.max_episode_tokens, self.max_turns),
                          sandbox_limits=self.sandbox_limits, context_length=self.context_length)
        await agent.rollout(sample, engine_turn(engine, seed, self.temperature, self.context_length))
        answer = sample.metadata.get("submitted", sample.response_text)
        score = float(get_task(problem.metadata.get("task", self.task)).score(answer, problem.label))
        return EpisodeResult(score, info={"turns": sample.metadata.get("turns", 0),
                                          "submitted": "submitted" in sample.metadata, "status": sample.status.value})
