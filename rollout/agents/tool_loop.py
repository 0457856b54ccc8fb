"""Multi-turn tool loop: the model calls a Python tool and submits an answer.

Protocol (Qwen/Hermes style, tokens in the tiny tokenizer's vocabulary):
    <tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>
    <tool_call>{"name": "submit", "arguments": {"answer": "42"}}</tool_call>
Each turn is generated until EOS or ``</tool_call>``. A python call runs in the sandbox; its output
is appended as ``<tool_response>...</tool_response>`` observation tokens with loss_mask 0,
rollout_logprob 0.0 and the weight version of the action token before them (they are context, not
actions: the skip-observation GAE gives them no value, reward or loss). A submit call ends the
episode with ``metadata["submitted"]`` (which the task rewards score); EOS without a call ends it
with the plain response.

Budgets: ``max_turns`` model turns, ``max_total_tokens`` response tokens (actions + observations),
``max_turn_tokens`` per turn, ``max_observation_tokens`` per tool output, and ``context_length``
(model.max_seq_len) for prompt + response: SGLang refuses a request past its context, so the turn
function caps each turn to it (rollout/context.py), and an observation that would fill it is not
appended. An exhausted budget ends the episode as TRUNCATED.

The loop is re-entrant: its state is the sample itself (``metadata["turns"]`` and the tokens), so a
sample restored from a checkpoint mid-episode continues where it stopped.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from rollout.rewards.sandbox import SandboxLimits, run_python
from rollout.rewards.sandbox_bwrap import require_bwrap
from sao_megatron.core.records import Sample, SampleStatus

TurnFn = Callable[[Sample, int, list[int]], Awaitable[str]]
CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    closed: bool              # the model wrote </tool_call> itself


def parse_tool_call(text: str) -> Optional[ToolCall | str]:
    """The last tool call in `text`: a ToolCall, an error string for a malformed one, or None."""
    matches = CALL.findall(text)
    if not matches:
        return None
    body, close = matches[-1]
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"error: tool call is not valid JSON ({exc.msg})"
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(data.get("arguments", {}), dict):
        return 'error: a tool call is {"name": str, "arguments": {...}}'
    return ToolCall(data["name"], data.get("arguments", {}), bool(close))


def observation_budget(max_episode_tokens: int, max_turns: int) -> int:
    """Tokens one tool output may take: the episode's budget shared over its turns (at least one)."""
    return max(1, max_episode_tokens // max_turns)


class ToolAgent:
    def __init__(self, tokenizer, *, max_turns: int = 4, max_total_tokens: int = 256, max_turn_tokens: int = 64,
                 max_observation_tokens: int = 64, sandbox_limits: SandboxLimits = SandboxLimits(wall_time_s=5),
                 context_length: Optional[int] = None):
        self.tokenizer = tokenizer
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.max_turn_tokens, self.max_observation_tokens = max_turn_tokens, max_observation_tokens
        self.sandbox_limits = sandbox_limits
        self.context_length = context_length
        self.call_end = self._special_id("</tool_call>")
        self.stop_ids = [tokenizer.eos_token_id, self.call_end]

    @classmethod
    def from_config(cls, cfg, tokenizer, context_length: Optional[int] = None, **kwargs) -> "ToolAgent":
        """rollout.agent = 'python_tool': budgets from the rollout section (max_new_tokens per turn)."""
        limits = SandboxLimits(wall_time_s=5, isolation=getattr(cfg, "sandbox", "bwrap"))
        if limits.isolation == "bwrap":   # one line at start (rollout.sandbox), not a crash at the first call
            require_bwrap()
        return cls(tokenizer, max_turns=cfg.max_turns, max_total_tokens=cfg.max_episode_tokens,
                   max_turn_tokens=cfg.max_new_tokens,
                   max_observation_tokens=observation_budget(cfg.max_episode_tokens, cfg.max_turns),
                   sandbox_limits=limits, context_length=context_length, **kwargs)

    def _special_id(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {token!r} token; the agent loop needs the tool-call special tokens")
        return tid

    async def rollout(self, sample: Sample, turn: TurnFn, tokenizer=None) -> None:
        """Run turns onto `sample` until submit, EOS, or a budget; sets its status and response_text."""
        sample.metadata.setdefault("turns", 0)
        while sample.status != SampleStatus.FAILED:
            pending = self._dangling_call(sample)
            if pending is not None:
                if not await self._answer(sample, pending):
                    break
                continue
            budget = min(self.max_turn_tokens, self.max_total_tokens - len(sample.response_ids))
            if budget <= 0 or sample.metadata["turns"] >= self.max_turns:
                sample.status = SampleStatus.TRUNCATED
                break
            start = len(sample.response_ids)
            finish = await turn(sample, budget, self.stop_ids)
            if finish == "failed":
                return
            sample.metadata["turns"] += 1
            text = self.tokenizer.decode(sample.response_ids[start:], skip_special_tokens=False)
            if parse_tool_call(text) is None:
                sample.status = SampleStatus.COMPLETED if finish == "stop" else SampleStatus.TRUNCATED
                break
        sample.response_text = self.tokenizer.decode(
            [t for t, m in zip(sample.response_ids, sample.loss_mask) if m], skip_special_tokens=True)

    def _dangling_call(self, sample: Sample):
        """A tool call at the end of the last action segment that has no observation yet."""
        if not sample.loss_mask or sample.loss_mask[-1] != 1:
            return None
        start = len(sample.loss_mask)
        while start > 0 and sample.loss_mask[start - 1] == 1:
            start -= 1
        text = self.tokenizer.decode(sample.response_ids[start:], skip_special_tokens=False)
        return parse_tool_call(text)

    async def _answer(self, sample: Sample, call) -> bool:
        """Handle a call: submit ends the episode (False); a tool appends its observation (True)."""
        if isinstance(call, ToolCall) and call.name == "submit":
            sample.metadata["submitted"] = str(call.arguments.get("answer", ""))
            sample.status = SampleStatus.COMPLETED
            return False
        if sample.metadata["turns"] >= self.max_turns:
            sample.status = SampleStatus.TRUNCATED
            return False
        output = await self._run_tool(call)
        prefix = "" if not isinstance(call, ToolCall) or call.closed else "</tool_call>"
        ids = self._observation_ids(prefix, output)
        if len(sample.response_ids) + len(ids) >= self.max_total_tokens or self._fills_context(sample, ids):
            sample.status = SampleStatus.TRUNCATED
            return False
        append_observation(sample, ids)
        return True

    def _fills_context(self, sample: Sample, ids: list[int]) -> bool:
        """Whether appending `ids` would leave no room in the context for the next turn's first token."""
        return self.context_length is not None and sample.num_tokens + len(ids) >= self.context_length

    async def _run_tool(self, call) -> str:
        if isinstance(call, str):
            return call
        if call.name != "python":
            return f"error: unknown tool {call.name!r}; tools are python and submit"
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return "error: python needs {\"code\": str}"
        result = await run_python(code, self.sandbox_limits)
        if result.limit:
            return f"error: {result.limit} limit exceeded"
        if result.returncode != 0:
            return "error: " + (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        return result.stdout

    def _observation_ids(self, prefix: str, output: str) -> list[int]:
        body = self.tokenizer.encode(output, add_special_tokens=False)[: self.max_observation_tokens]
        head = self.tokenizer.encode(f"{prefix}\n<tool_response>", add_special_tokens=False)
        tail = self.tokenizer.encode("</tool_response>\n", add_special_tokens=False)
        return head + list(body) + tail


def append_observation(sample: Sample, ids: list[int]) -> None:
    """Environment tokens: in the context, out of the loss (mask 0, logprob 0, last action's version)."""
    version = sample.weight_versions[-1] if sample.weight_versions else 0
    sample.response_ids.extend(ids)
    sample.loss_mask.extend([0] * len(ids))
    sample.rollout_logprobs.extend([0.0] * len(ids))
    sample.weight_versions.extend([version] * len(ids))
    sample.routed_experts = None      # the next turn's engine result covers the observation again
    sample.indexer_topk = None


class FunctionAgent:
    """rollout.generate_fn: the user's ``async fn(sample, turn, tokenizer)`` runs each sample's rollout.

    ``turn(sample, max_new_tokens, stop_ids)`` generates one segment onto the sample (loss_mask 1, the
    engines' logprobs and weight versions, failover and continuation across weight updates included)
    and returns "stop", "length" or "failed"; environment tokens go in with `append_observation`
    (loss_mask 0). The function may set ``sample.status``, ``response_text`` and ``metadata`` (the
    reward sees them); ``metadata["turns"]`` defaults to the number of turn calls.
    """

    def __init__(self, fn, path: str = ""):
        self.fn, self.path = fn, path

    async def rollout(self, sample: Sample, turn: TurnFn, tokenizer) -> None:
        calls = 0

        async def counted(s: Sample, max_new_tokens: int, stop_ids: list[int]) -> str:
            nonlocal calls
            calls += 1
            return await turn(s, max_new_tokens, stop_ids)

        await self.fn(sample, counted, tokenizer)
        sample.metadata.setdefault("turns", calls)
        if sample.status in (SampleStatus.PENDING, SampleStatus.ABORTED):
            sample.status = SampleStatus.COMPLETED
        if not sample.response_text:
            sample.response_text = tokenizer.decode(
                [t for t, m in zip(sample.response_ids, sample.loss_mask) if m], skip_special_tokens=True)
