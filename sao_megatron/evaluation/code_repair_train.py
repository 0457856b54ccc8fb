"""The code-repair environment for training (`rollout.agent = "code_repair"`).

Rows are the benchmark's (code_repair.py: ``id``, ``issue``, ``files``, ``tests``, optional
``test_command``) read as a rollout dataset with ``rollout.prompt_key = "issue"``: every other field
reaches the sample's metadata. An episode opens with the file list as an observation (loss_mask 0),
then runs the benchmark's tool loop (RepoAgent: read_file, write_file, python, submit) on a copy of
the row's repository kept in ``metadata["workspace"]``, so a sample resumed mid-episode keeps its
edits. The reward runs the hidden tests on the repository after the submission, exactly as the
benchmark scores it (1.0 only if they ran to their end).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from rollout.agents.tool_loop import ToolAgent, append_observation, observation_budget
from rollout.rewards.sandbox import SandboxLimits
from rollout.rewards.sandbox_bwrap import require_bwrap
from sao_megatron.core.records import Sample, SampleStatus

from .code_repair import CodeRepairEval, RepairTask, RepoAgent, run_hidden_tests
from .patches import PatchError, apply_submission, safe_path


class CodeRepairAgent:
    def __init__(self, tokenizer, limits: SandboxLimits, context_length: Optional[int] = None, **budgets):
        self.tokenizer, self.limits, self.context_length, self.budgets = tokenizer, limits, context_length, budgets
        self.reward_fn = CodeRepairReward(limits)

    @classmethod
    def from_config(cls, cfg, tokenizer, context_length: Optional[int] = None) -> "CodeRepairAgent":
        limits = dataclasses.replace(CodeRepairEval.sandbox_limits, isolation=getattr(cfg, "sandbox", "bwrap"))
        if limits.isolation == "bwrap":   # one line at start (rollout.sandbox), not a crash at the first call
            require_bwrap()
        return cls(tokenizer, limits, context_length, max_turns=cfg.max_turns, max_turn_tokens=cfg.max_new_tokens,
                   max_total_tokens=cfg.max_episode_tokens,
                   max_observation_tokens=observation_budget(cfg.max_episode_tokens, cfg.max_turns))

    async def rollout(self, sample: Sample, turn, tokenizer=None) -> None:
        meta = sample.metadata
        if "workspace" not in meta:
            try:
                meta["workspace"] = _files(meta.get("files"), "files")
            except PatchError as exc:
                sample.status, meta["error"] = SampleStatus.FAILED, f"code_repair row: {exc}"
                return
            listing = "Files: " + ", ".join(sorted(meta["workspace"])) + "\n"
            append_observation(sample, self.tokenizer.encode(listing, add_special_tokens=False))
        agent: ToolAgent = RepoAgent(self.tokenizer, meta["workspace"], sandbox_limits=self.limits,
                                     context_length=self.context_length, **self.budgets)
        await agent.rollout(sample, turn)


class CodeRepairReward:
    """1.0 when the row's hidden tests pass on the repository after the submission, else 0.0."""

    def __init__(self, limits: SandboxLimits):
        self.limits = limits

    async def __call__(self, sample: Sample) -> dict:
        meta = sample.metadata
        try:
            tests = _files(meta.get("tests"), "tests")
            final = apply_submission(meta["workspace"], meta.get("submitted", ""))
        except PatchError as exc:
            return {"reward": 0.0, "repair_error": str(exc)}
        task = RepairTask(str(meta.get("id", sample.uid)), int(meta.get("line", 0)), "", meta["workspace"], tests,
                          str(meta.get("test_command", "")))
        passed, result = await run_hidden_tests(task, final, self.limits)
        return {"reward": 1.0 if passed and not result.limit else 0.0}


def _files(value, name: str) -> dict[str, str]:
    if not isinstance(value, dict) or not value or not all(isinstance(v, str) for v in value.values()):
        raise PatchError(f"{name!r} must be a non-empty object {{path: content}}")
    return {safe_path(k): v for k, v in value.items()}
