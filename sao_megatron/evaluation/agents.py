"""The rollout side's plug-ins of a recipe: `rollout.agent` and `rollout.generate_fn` (docs/rollout.md, Agents).

The agents live where their tools do: the python-tool agent in rollout/agents/tool_loop.py, the code-repair
environment beside its benchmark (code_repair_train.py). This module sits above both layers, so the
trainer builds either through one call. A recipe can also name its own class, 'pkg.mod:Class', with
``from_config(rollout_cfg, tokenizer, context_length)``; an agent with a ``reward_fn`` attribute
scores its own episodes unless rollout.reward_fn is set.
"""
from __future__ import annotations

from typing import Any, Optional

from rollout.agents.tool_loop import FunctionAgent
from rollout.rewards import resolve_reward_fn
from sao_megatron.core.imports import resolve_import_path

# rollout.agent name -> 'module:Class' (the names are listed in sao_megatron/core/config/schema.py AGENTS)
AGENTS = {
    "python_tool": "rollout.agents.tool_loop:ToolAgent",
    "code_repair": "sao_megatron.evaluation.code_repair_train:CodeRepairAgent",
}


def build_agent(cfg, tokenizer, context_length: Optional[int] = None) -> Optional[Any]:
    """The object whose ``rollout(sample, turn, tokenizer)`` the driver runs per sample, or None (one turn)."""
    if cfg.generate_fn:
        fn = resolve_import_path(cfg.generate_fn, "rollout.generate_fn", want_callable=True)
        return FunctionAgent(fn, cfg.generate_fn)
    if not cfg.agent:
        return None
    cls = resolve_import_path(AGENTS.get(cfg.agent, cfg.agent), "rollout.agent")
    return cls.from_config(cfg, tokenizer, context_length)


def build_rollout_plugins(cfg, tokenizer, context_length: Optional[int] = None):
    """(agent or None, reward_fn): rollout.reward_fn wins; else the agent's own reward; else the task's."""
    agent = build_agent(cfg, tokenizer, context_length)
    own = getattr(agent, "reward_fn", None)
    return agent, (own if own is not None and not cfg.reward_fn else resolve_reward_fn(cfg))
