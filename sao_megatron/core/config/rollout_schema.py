"""The [rollout] recipe section: engines, sampling, data, agents and the staleness bound (split from
schema.py, which re-exports every name). Standard library only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from . import text_rules
from .bounds import check_bounds
from .fields import doc, require
from ..imports import resolve_import_path

ENGINE_ARGS_CHECK = "rollout.engines.sglang_flags:check_engine_args"
BLACKWELL = ("b200", "b300", "gb200", "gb300")   # SM100/SM103: DeepGEMM's UE8M0 scales in SGLang


@dataclass
class RolloutConfig:
    engine: Literal["reference", "sglang"] = doc("reference", "Engine kind: reference CPU server or SGLang.")
    engine_urls: list = doc([], "URLs of running engines; empty = start num_engines engines locally.")
    num_engines: int = doc(1, "Engines to start when engine_urls is empty.", bounds=">= 1")
    host: str = doc("127.0.0.1", "Host the started engines bind to.")
    port: int = doc(0, "First engine port; 0 = pick free ports.", bounds="[0, 65535]")
    api_key: str = doc("", "API key the engines require ('' = generate one per run).")
    engine_tp: int = doc(1, "Tensor-parallel ranks per engine (SGLang --tp-size, reference server --tp); each rank "
                            "joins the weight-update group, so with engine_urls it must equal the engines' own tp.",
                            bounds=">= 1")
    engine_ep: int = doc(1, "SGLang: expert parallel size per engine.", bounds=">= 1")
    engine_dp_attention: int = doc(0, "SGLang: dp-attention size (0 = off).", bounds=">= 0")
    mem_fraction: float = doc(0.7, "SGLang: --mem-fraction-static.", bounds="(0, 1)")
    engine_fp8: bool = doc(False, "Engines serve block-FP8 (128x128) weights (--quantization fp8) and weight sync "
                                  "sends them FP8 blocks with their scales (docs/weight-transports.md, FP8 engines).")
    engine_dtype: Literal["fp32", "bf16"] = doc(
        "fp32", "Reference engines: the dtype they run in (--dtype); weight sync casts the trainer's weights to it. "
                "bf16 against the fp32 trainer is a real train/inference mismatch (what DIS and the mismatch "
                "corrections are for).")
    engine_model_path: str = doc("", "Checkpoint the engines load ('' = model.path). SGLang with engine_fp8: a "
                                     "block-FP8 checkpoint of the model (quantization_config fp8, [128, 128] blocks).")
    engine_gpu: Literal["", "h100", "h200", "h20", "b200", "b300", "gb200", "gb300"] = doc(
        "", "GPU model the SGLang engines run on ('' = not stated). FP8 engines are refused on Blackwell, where "
            "SGLang 0.5.23 re-quantises block scales to powers of two at load (docs/engines.md).")
    engine_args: list = doc([], "SGLang: extra `sglang.launch_server` flags appended to every engine's argv (and to "
                                "`sao launch`'s script), each flag and value its own item, e.g. "
                                "[\"--chunked-prefill-size\", \"4096\"]; checked against SGLang 0.5.23's flags. "
                                "Flags other fields set, and speculative decoding, are refused (docs/engines.md).")
    mode: Literal["single", "group"] = doc("single", "single: one rollout per prompt (SAO); group: n per prompt.")
    n_samples_per_prompt: int = doc(1, "Rollouts per prompt in group mode.", bounds=">= 1")
    batch_size: int = doc(16, "Samples per policy step (SAO paper: 128).", bounds=">= 1")
    max_in_flight: int = doc(32, "Requests kept in flight across all engines.", bounds=">= 1")
    temperature: float = doc(1.0, "Sampling temperature (> 0; RL needs a stochastic policy).", bounds="> 0")
    top_p: float = doc(1.0, "Nucleus sampling p in (0, 1].", bounds="(0, 1]")
    top_k: int = doc(-1, "Top-k sampling; -1 = off, else k >= 1 (0 would keep no token).", bounds=">= -1")
    max_new_tokens: int = doc(64, "Response token budget per turn.", bounds=">= 1")
    max_prompt_len: int = doc(256, "Prompts longer than this are rejected by policy bad_row.", bounds=">= 1")
    staleness_bound: int = doc(4, "Drop/regenerate samples whose oldest token is more than tau versions old.",
                               bounds=">= 0")
    stale_policy: Literal["drop", "regenerate"] = doc("drop", "What to do with a sample over the staleness bound.")
    request_timeout_s: float = doc(600.0, "Timeout of one generate call.", bounds="(0, 604800]")
    task: str = doc("countdown", "Built-in task (countdown, arithmetic, copy, digits, online) or '' to use dataset.")
    dataset: str = doc("", "Prompt file (jsonl or parquet) with a 'prompt' field (and 'answer').")
    env_switch_every: int = doc(50, "Task 'online': the rewarded rule switches every this many trainer steps.",
                                bounds=">= 1")
    env_rules: list = doc([], "Task 'online': the cycle of rules, one per phase ([] = digits, capitals, punctuation; "
                              "drift_digits, drift_capitals, drift_punctuation: overlapping classes, "
                              "rollout/rewards/environments.py).")
    bad_row: Literal["skip", "fail"] = doc("skip", "A malformed dataset row is reported and skipped, or fails the run.")
    prompt_key: str = doc("prompt", "Dataset field holding the prompt (a string or a list of chat messages).")
    label_key: str = doc("", "Dataset field holding the label the reward checks; '' = 'answer', else 'label'.")
    dataset_split: str = doc("train", "Split read from an HF dataset directory that has several.")
    system_prompt: str = doc("", "System message put before every prompt ('' = none; a row's own system message wins).")
    enable_thinking: Optional[bool] = doc(None, "Passed to the chat template as enable_thinking (Qwen3: false turns "
                                                "thinking off); None = the template's default.")
    chat_template_kwargs: dict = doc({}, "Extra keyword arguments for tokenizer.apply_chat_template (e.g. "
                                         "{reasoning_effort = 'low'}).")
    reward_fn: str = doc("", "Reward function import path 'pkg.mod:fn' (imported when the recipe is checked); "
                             "'' = the task's own.")
    reward_timeout_s: float = doc(10.0, "Timeout of one reward call; a timeout marks the sample failed.",
                                  bounds="(0, 86400]")
    sandbox: Literal["bwrap", "unsafe-no-isolation"] = doc(
        "bwrap", "How model-written code (code rewards, the python tool) is isolated: bwrap (bubblewrap: own "
                 "namespaces, read-only system, rlimits; refuses to run where bwrap is missing) or "
                 "unsafe-no-isolation (a subprocess with rlimits and an in-process guard only, which code can undo).")
    max_failed_in_a_row: int = doc(0, "Samples failing one after another (every engine attempt, or the reward) "
                                      "before the run stops naming the cause; 0 = 2 x max_in_flight.", bounds=">= 0")
    engine_down_timeout_s: float = doc(60.0, "Every engine unreachable this long stops the run with an error.",
                                       bounds="> 0")
    engine_restarts: int = doc(2, "Restarts of locally started engines that exit, per run (their requests are "
                                  "re-issued); engines at engine_urls are not restarted.", bounds=">= 0")
    agent: str = doc("", "Multi-turn agent run on every prompt: '' = one turn; 'python_tool' (python + submit "
                         "tools, rollout/agents/tool_loop.py); 'code_repair' (read/write/python/submit on the row's repository, "
                         "scored by its hidden tests); or 'pkg.mod:Class' with from_config(rollout_cfg, tokenizer, "
                         "context_length) (docs/rollout.md, Agents).")
    generate_fn: str = doc("", "Your own async rollout 'pkg.mod:fn', called as await fn(sample, turn, tokenizer) for "
                               "every sample ('' = the driver's; not with rollout.agent; docs/rollout.md, Agents).")
    max_turns: int = doc(4, "Agents: model turns per episode (each up to max_new_tokens tokens).", bounds=">= 1")
    max_episode_tokens: int = doc(256, "Agents: response tokens per episode, actions and tool outputs together; one "
                                       "tool output is cut to max_episode_tokens / max_turns (at least max_turns).")

    def check(self, p: str) -> None:
        require(self.temperature > 0, f"{p}.temperature",
                 f"{self.temperature} <= 0 is greedy decoding, not a valid RL policy", "use 1.0 (the SAO setting)")
        require(0 < self.top_p <= 1, f"{p}.top_p", f"{self.top_p} not in (0, 1]", "use 1.0")
        require(self.num_engines >= 1 or bool(self.engine_urls), f"{p}.num_engines",
                 "no engines", "set rollout.num_engines >= 1 or list rollout.engine_urls")
        require(self.max_failed_in_a_row >= 0, f"{p}.max_failed_in_a_row", f"{self.max_failed_in_a_row} < 0",
                 "use 0 (auto) or a positive count")
        require(self.engine_down_timeout_s > 0, f"{p}.engine_down_timeout_s", f"{self.engine_down_timeout_s} <= 0",
                 "use e.g. 60")
        require(self.engine_restarts >= 0, f"{p}.engine_restarts", f"{self.engine_restarts} < 0", "use 0 (never) or more")
        require(bool(self.task) or bool(self.dataset), f"{p}.dataset", "neither task nor dataset is set",
                 "set rollout.task (e.g. countdown) or rollout.dataset to a jsonl file")
        require(self.top_k != 0, f"{p}.top_k", "0 keeps no token", "use -1 (off) or a positive k")
        text_rules.check_rollout_text(self, p)
        self._check_agent(p)
        check_data_keys(self, p)
        require(not (self.engine == "sglang" and self.engine_fp8 and self.engine_gpu in BLACKWELL), f"{p}.engine_fp8",
                 f"FP8 engines on {self.engine_gpu}: SGLang 0.5.23 re-quantises their block scales to UE8M0 (powers "
                 "of two, DeepGEMM's layout) at first load on Blackwell, and weight updates carry amax/448 scales",
                 "set rollout.engine_fp8 = false (bf16 engines) or run the engines on Hopper (h100, h200)")
        require(self.engine_dtype == "fp32" or (self.engine == "reference" and not self.engine_fp8),
                 f"{p}.engine_dtype", f"{self.engine_dtype!r} is for the reference engine without engine_fp8",
                 "SGLang engines choose their dtype from the checkpoint; set rollout.engine_dtype = 'fp32'")
        if self.engine_args:   # SGLang's flag table lives with the launcher (rollout/), reached by path
            require(self.engine == "sglang", f"{p}.engine_args", "SGLang flags with rollout.engine = "
                     f"{self.engine!r}", "clear rollout.engine_args or set rollout.engine = 'sglang'")
            resolve_import_path(ENGINE_ARGS_CHECK, f"{p}.engine_args")(self.engine_args)
        check_bounds(self, p)

    def _check_agent(self, p: str) -> None:
        require(self.agent in AGENTS or ":" in self.agent, f"{p}.agent", f"{self.agent!r} is not an agent",
                 f"use one of {', '.join(repr(a) for a in AGENTS)} or 'pkg.mod:Class'")
        if ":" in self.agent:
            text_rules.import_path(f"{p}.agent", self.agent)
        text_rules.import_path(f"{p}.generate_fn", self.generate_fn)
        require(self.agent != "code_repair" or bool(self.dataset), f"{p}.dataset", "rollout.agent = 'code_repair' "
                 "needs repository rows", "set rollout.dataset to a code-repair jsonl and rollout.prompt_key = 'issue'")
        require(not (self.agent and self.generate_fn), f"{p}.generate_fn", "is set together with rollout.agent",
                 "keep one: an agent runs its own turns, generate_fn replaces the whole rollout")
        require(self.max_episode_tokens >= self.max_turns, f"{p}.max_episode_tokens",
                 f"{self.max_episode_tokens} leaves no token per turn for {self.max_turns} turns",
                 "use at least rollout.max_turns tokens (e.g. 256)")


# apply_chat_template arguments the prompt source sets itself (rollout/prompts.py)
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                            "enable_thinking")


def check_data_keys(cfg, p: str) -> None:
    """Dataset field names and chat-template options (rollout's; sft's keys through check())."""
    for name in ("prompt_key", "dataset_split"):
        require(isinstance(getattr(cfg, name), str) and bool(getattr(cfg, name).strip()), f"{p}.{name}",
                 "is empty", "name a field of the dataset rows (e.g. 'prompt')" if name == "prompt_key"
                 else "use e.g. 'train'")
        text_rules.one_line(f"{p}.{name}", getattr(cfg, name))
    text_rules.one_line(f"{p}.label_key", cfg.label_key)
    require(cfg.label_key != cfg.prompt_key, f"{p}.label_key", f"is the prompt field {cfg.prompt_key!r} too",
             "name the field with the answer (or '' for 'answer'/'label')")
    kwargs = cfg.chat_template_kwargs
    require(isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs), f"{p}.chat_template_kwargs",
             "is not a table of named values", "write e.g. chat_template_kwargs = {reasoning_effort = 'low'}")
    taken = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    require(not taken, f"{p}.chat_template_kwargs", f"sets {', '.join(taken)}, which the prompt source sets",
             "remove it (use rollout.enable_thinking for enable_thinking)")


# rollout.agent's built-in names (the classes: sao_megatron/evaluation/agents.py AGENTS)
AGENTS = ("", "python_tool", "code_repair")
