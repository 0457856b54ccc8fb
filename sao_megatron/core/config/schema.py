"""Typed recipe sections. Imports nothing but the standard library (no torch, no Megatron).

Every field carries its documentation in ``metadata["doc"]`` and, where check() limits it, its
accepted values in ``metadata["bounds"]`` (both shown by ``sao train --help-recipe``).
Each section checks its own ranges in ``check()``; checks that span sections live on ``Recipe``.
The [rollout] section lives in rollout_schema.py, the field helpers in fields.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from . import text_rules
from .bounds import check_bounds
from .fields import doc, require
from .rollout_schema import AGENTS, RolloutConfig  # noqa: F401  (AGENTS: the recipe's rollout.agent names)


@dataclass
class RunConfig:
    name: str = doc("sao-run", "Run name; the run directory is <output_dir>/<name>. Letters, digits, '.', '_' "
                               "and '-', starting with a letter or digit (never '.', '..' or a path).")
    output_dir: str = doc("runs", "Parent directory of run directories.")
    seed: int = doc(1234, "Global seed for sampling, data order and initialisation.", bounds="[0, 2147483647]")
    num_steps: int = doc(100, "Optimizer steps of the policy (critic warm-up steps not included).", bounds=">= 0")
    debug: Literal["none", "rollout-only", "train-only"] = doc(
        "none", "rollout-only saves rollouts without training; train-only trains from debug_dir.")
    debug_dir: str = doc("", "Saved rollouts to train from (debug = train-only).")

    def check(self, p: str) -> None:
        text_rules.plain_name(f"{p}.name", self.name)
        require(self.num_steps >= 0, f"{p}.num_steps", f"{self.num_steps} < 0", "use 0 or more")
        require(self.debug != "train-only" or bool(self.debug_dir), f"{p}.debug_dir",
                 "train-only needs saved rollouts", "set run.debug_dir to a rollout-only run's rollouts dir")
        text_rules.one_line(f"{p}.output_dir", self.output_dir, empty_ok=False)
        text_rules.one_line(f"{p}.debug_dir", self.debug_dir)
        check_bounds(self, p)


@dataclass
class ModelConfig:
    path: str = doc("", "HF model directory (config.json + safetensors + tokenizer).")
    arch: str = doc("qwen3_moe", "Architecture family: a name registered in checkpoints/arch "
                                 "(checked against the registry when a command loads the recipe).")
    init_preset: str = doc("", "If set and `path` does not exist, `sao init-model` creates it with this preset (tiny).")
    shape_preset: str = doc("", "Named architecture shapes (parallel/model_shapes.py) used by `sao plan` and "
                                "`sao launch` when model.path is not on this machine.")
    dtype: Literal["fp32", "bf16"] = doc("fp32", "Parameter dtype of the trainer (fp32 on CPU).")
    max_seq_len: int = doc(512, "Longest prompt + response the trainer accepts.", bounds=">= 1")
    fp8: Literal["none", "delayed", "tensorwise", "blockwise", "mxfp8"] = doc(
        "none", "FP8 recipe through Transformer Engine (GPU only).")
    transformer_impl: Literal["auto", "local", "transformer_engine"] = doc(
        "auto", "Layer spec: auto = Transformer Engine when CUDA and TE are present, else local.")
    recompute: Literal["none", "selective", "full"] = doc("none", "Activation recomputation.")
    indexer_loss_coeff: float = doc(0.0, "DSA models (GLM-5): weight of Megatron's indexer KL loss; 0 keeps the "
                                         "lightning indexer frozen, as Megatron's DSAttention does by default "
                                         "(the policy loss never reaches it: its inputs are detached).",
                                    bounds="[0, 10]")

    def check(self, p: str) -> None:
        require(bool(self.path), f"{p}.path", "no model directory given",
                 "set model.path (create one with `sao init-model --arch qwen3_moe --preset tiny DIR`)")
        for name in ("path", "init_preset", "shape_preset"):
            text_rules.one_line(f"{p}.{name}", getattr(self, name))
        check_bounds(self, p)


@dataclass
class ParallelConfig:
    tp: int = doc(1, "Tensor parallel size.", bounds=">= 1")
    pp: int = doc(1, "Pipeline parallel size.", bounds=">= 1")
    vpp: int = doc(1, "Virtual pipeline stages per pipeline rank (interleaved 1F1B).", bounds=">= 1")
    last_stage_layers: int = doc(0, "Decoder layers on the last pipeline rank (Megatron's uneven last stage, "
                                    "num_layers_in_last_pipeline_stage); 0 = even when pp*vpp divides the "
                                    "layers, else ceil(layers/pp) on the other ranks.", bounds=">= 0")
    ep: int = doc(1, "Expert parallel size.", bounds=">= 1")
    etp: int = doc(0, "Expert tensor parallel size; 0 = same as tp (leave it unless you mean it).", bounds=">= 0")
    cp: int = doc(1, "Context parallel size.", bounds=">= 1")
    dp: int = doc(0, "Data parallel size; 0 = world_size / (tp*pp*cp).", bounds=">= 0")
    world_size: int = doc(0, "Trainer ranks; 0 = tp*pp*cp*max(dp,1).", bounds=">= 0")
    sequence_parallel: bool = doc(True, "Sequence parallel under TP (forced on for MoE with tp > 1).")
    micro_batch_tokens: int = doc(4096, "Token budget of one packed micro-batch per context-parallel rank; at "
                                         "least one whole sequence, (max_prompt_len + max_new_tokens) / cp.",
                                   bounds=">= 16")
    pack_sequences: bool = doc(True, "Micro-batches hold samples back to back without padding (THD: attention "
                                     "per sample); micro_batch_tokens then counts real tokens. Pays off on "
                                     "long-tailed lengths; on CPU short, alike samples train faster padded "
                                     "(sao bench packing). Not with cp > 1.")
    dispatcher: Literal["alltoall", "allgather", "flex"] = doc(
        "alltoall", "MoE token dispatcher; flex = DeepEP (GPU, deep_ep installed, tp*ep > 1).")
    distributed_optimizer: bool = doc(False, "Megatron distributed optimizer (GPU).")
    optimizer_offload: bool = doc(False, "Adam state and fp32 master weights on the host, updated by CPU Adam "
                                         "(Megatron's HybridDeviceOptimizer; GPU only, needs distributed_optimizer).")
    launcher: Literal["auto", "torchrun", "mpirun", "none"] = doc(
        "auto", "How `sao train` starts ranks on one machine when world_size > 1.")

    def check(self, p: str) -> None:
        require(not self.optimizer_offload or self.distributed_optimizer, f"{p}.optimizer_offload",
                 "needs the distributed optimizer", "set parallel.distributed_optimizer = true")
        require(not (self.pack_sequences and self.cp > 1), f"{p}.pack_sequences",
                 f"packed rows are not split per sample over cp = {self.cp} ranks yet",
                 "set parallel.pack_sequences = false with context parallelism")
        check_bounds(self, p)

    def resolved_world_size(self) -> int:
        base = self.tp * self.pp * self.cp
        if self.world_size:
            return self.world_size
        return base * max(self.dp, 1)


@dataclass
class AlgorithmConfig:
    name: str = doc("sao", "Preset: sao, grpo, grpo_dis, gspo, gspo_token, dapo, drgrpo, rloo, reinforce_pp, "
                                "running_mean, ppo.")
    loss: str = doc("", "Policy loss (dis, ppo, gspo, gspo_token, cispo) or 'pkg.mod:fn'; '' = preset's.")
    advantage: str = doc("", "Advantage estimator (gae, grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline, "
                             "running_mean).")
    eps_low: Optional[float] = doc(None, "Lower band/clip: ratio must exceed 1 - eps_low.", bounds="> 0")
    eps_high: Optional[float] = doc(None, "Upper band/clip: ratio must stay below 1 + eps_high. Never defaults to eps_low.",
                                    bounds="> 0")
    dual_clip: Optional[float] = doc(None, "PPO dual-clip constant c > 1 (None = off).", bounds="> 1")
    normalize_over: Literal["all", "kept"] = doc(
        "all", "DIS normaliser: all action tokens (default) or only tokens inside the band.")
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = doc(
        "token-mean", "Loss aggregation, normalised by global counts across micro-batches and DP ranks.")
    gamma: float = doc(1.0, "Discount.", bounds="[0, 1]")
    lambda_actor: Optional[float] = doc(None, "Policy GAE lambda; None = length-adaptive 1 - 1/(alpha*l).",
                                        bounds="[0, 1]")
    lambda_critic: float = doc(1.0, "Critic target lambda (SAO: 1.0, Monte-Carlo returns).", bounds="[0, 1]")
    alpha: float = doc(1.5, "Length-adaptive lambda constant.", bounds="> 0")
    baseline_momentum: float = doc(0.9, "Running-mean baseline: b <- m*b + (1-m)*mean(r) (advantage running_mean).",
                                   bounds="[0, 1)")
    kl_coef: float = doc(0.0, "KL penalty coefficient against the reference policy (SAO: 0). > 0 builds a "
                              "reference model (docs/algorithms.md, 'KL to a reference').", bounds=">= 0")
    kl_estimator: Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl"] = doc(
        "k3", "KL estimator: k1 (= verl's 'kl'), k2 (= 'mse'), k3, or low_var_kl (k3 clamped to [-10, 10], "
              "as verl and slime).")
    kl_in: Literal["loss", "reward"] = doc(
        "loss", "Where the KL goes: a loss term (GRPO, slime --use-kl-loss) or a per-token reward penalty "
                "(InstructGPT, verl use_kl_in_reward).")
    ref_model_path: str = doc("", "Reference model (an HF directory of the same architecture); '' = the initial "
                                  "policy (model.path).")
    entropy_coef: float = doc(0.0, "Entropy bonus (SAO: 0).", bounds=">= 0")
    correction: Literal["none", "tis", "mis", "icepop"] = doc("none", "Train/inference mismatch correction.")
    correction_low: float = doc(0.5, "MIS lower bound / IcePop alpha.", bounds=">= 0")
    correction_high: float = doc(2.0, "TIS cap C / MIS upper bound / IcePop beta.", bounds="> 0")
    correction_level: Literal["token", "sequence"] = doc("token", "MIS granularity.")
    dynamic_sampling: bool = doc(False, "Group mode: drop groups whose rewards are all equal.")
    overlong_max: int = doc(0, "DAPO overlong shaping L_max (0 = off).", bounds=">= 0")
    overlong_cache: int = doc(0, "DAPO overlong shaping L_cache.", bounds=">= 0")
    lr: float = doc(1e-6, "Policy learning rate, the peak of lr_schedule (SAO: 1e-6 constant).", bounds="(0, 1]")
    lr_schedule: Literal["constant", "linear", "cosine"] = doc(
        "constant", "Policy learning-rate decay after warm-up, to lr_min at the last optimizer step "
                    "(Megatron's OptimizerParamScheduler).")
    lr_warmup_steps: int = doc(0, "Policy optimizer steps of linear warm-up from 0 to lr.", bounds=">= 0")
    lr_min: float = doc(0.0, "Policy learning rate at the end of a linear or cosine decay.", bounds=">= 0")
    weight_decay: float = doc(0.0, "AdamW weight decay.", bounds="[0, 1]")
    adam_beta1: float = doc(0.9, "Adam beta1.", bounds="[0, 1)")
    adam_beta2: float = doc(0.999, "Adam beta2.", bounds="[0, 1)")
    grad_clip: float = doc(1.0, "Max global grad norm (0 = off).", bounds=">= 0")
    mini_batches: int = doc(1, "Optimizer steps per rollout batch (GSPO: 4).", bounds=">= 1")

    def check(self, p: str) -> None:
        for name in ("eps_low", "eps_high"):
            value = getattr(self, name)
            require(value is not None, f"{p}.{name}", "is unset (it never defaults to the other side)",
                     f"set {p}.{name} explicitly, or pick a preset with {p}.name")
            require(value > 0, f"{p}.{name}", f"{value} <= 0", "use a positive band width")
        require(self.eps_low < 1 or self.loss not in ("dis", "ppo"), f"{p}.eps_low",
                 f"{self.eps_low} >= 1 empties the lower band", "use a value in (0, 1)")
        require(self.lr > 0, f"{p}.lr", f"{self.lr} <= 0", "use a positive learning rate such as 1e-6")
        _check_lr_schedule(self, p)
        if ":" in self.loss:
            text_rules.import_path(f"{p}.loss", self.loss)
        check_bounds(self, p)
        require(self.correction_low < self.correction_high, f"{p}.correction_low",
                 "is not below correction_high", "use e.g. 0.5 and 2.0")
        require(self.overlong_cache <= self.overlong_max, f"{p}.overlong_cache",
                 f"{self.overlong_cache} > overlong_max {self.overlong_max}",
                 "use a cache no longer than algorithm.overlong_max (or 0)")


@dataclass
class CriticConfig:
    enabled: bool = doc(True, "Train a value model (SAO). Group baselines need none.")
    lr: float = doc(5e-6, "Critic learning rate, the peak of lr_schedule (SAO: 5e-6).", bounds="(0, 1]")
    lr_schedule: Literal["constant", "linear", "cosine"] = doc(
        "constant", "Critic learning-rate decay after warm-up, to lr_min at the last critic optimizer step.")
    lr_warmup_steps: int = doc(0, "Critic optimizer steps of linear warm-up from 0 to lr.", bounds=">= 0")
    lr_min: float = doc(0.0, "Critic learning rate at the end of a linear or cosine decay.", bounds=">= 0")
    updates_per_step: int = doc(2, "Critic updates per policy update (SAO two-timescale: K = 2).", bounds=">= 1")
    warmup_steps: int = doc(10, "Critic-only steps before the first policy update.", bounds=">= 0")
    freeze_attention: bool = doc(True, "Train only MoE/expert projections, norms and the value head.")
    init_from_policy: bool = doc(True, "Initialise the critic backbone from the policy weights.")
    value_clip: Optional[float] = doc(None, "Value clipping range (None = plain masked MSE).", bounds="> 0")
    pretrain_steps: int = doc(0, "Value pretraining steps on the initial policy before training.", bounds=">= 0")
    placement: Literal["shared", "swap"] = doc(
        "shared", "shared: policy and critic both stay in device memory; swap: they take turns, the idle one "
        "parked in host memory (weights, grads, optimizer state; parallel/offload.py).")

    def check(self, p: str) -> None:
        check_bounds(self, p)
        _check_lr_schedule(self, p)


def _check_lr_schedule(section, p: str) -> None:
    require(section.lr_min <= section.lr, f"{p}.lr_min", f"{section.lr_min} > lr {section.lr}",
             f"use a floor at or below {p}.lr (0 decays to zero)")


@dataclass
class WeightSyncConfig:
    method: Literal["broadcast", "shard_writes", "disk"] = doc(
        "broadcast", "Broadcast over a process group; shard_writes: each engine TP rank receives only its slice "
        "(needs engines that take per-rank writes: the reference server with --shard-writes; docs/weights.md); "
        "or HF shards on disk.")
    backend: Literal["auto", "gloo", "nccl"] = doc("auto", "Collective backend: auto = nccl with CUDA, else gloo.")
    bucket_mb: float = doc(64.0, "Flattened bucket size in MiB.", bounds="(0, 65536]")
    pause_mode: Literal["in_place", "retract", "abort"] = doc("in_place", "Engine pause mode during a sync.")
    timeout_s: float = doc(120.0, "Timeout of every step of a sync; a dead engine is named within it.",
                           bounds="(0, 86400]")
    check_equal: bool = doc(False, "After each sync compare engine tensors against the trainer's (slow).")
    disk_dir: str = doc("", "Directory for the disk method ('' = <run_dir>/weights).")
    shard_senders: int = doc(2, "shard_writes: parallel sender lanes, each on its own group, the engine ranks "
                                "dealt out among them.", bounds=">= 1")
    max_sender_mb: float = doc(
        32768.0, "Bound on what a weight sender holds during a push beyond its model shards, for every method "
        "(broadcast, shard_writes lanes, disk shards; flat buffers, buckets, the tensor being gathered, FP8 "
        "quantizing); `sao train` and `sao launch` refuse one below what streaming needs for the model and "
        "method (rollout/weights/memory.py; docs/weight-transports.md, Sender memory).", bounds="> 0")
    senders: Literal["per_stage", "driver"] = doc(
        "per_stage", "broadcast with pipeline parallelism: each stage's first rank sends its own layers "
        "on its own group (per_stage), or every stage gathers to rank 0, the one sender (driver).")

    def check(self, p: str) -> None:
        require(self.bucket_mb > 0, f"{p}.bucket_mb", f"{self.bucket_mb} <= 0", "use e.g. 64")
        text_rules.one_line(f"{p}.disk_dir", self.disk_dir)
        check_bounds(self, p)


@dataclass
class CheckpointConfig:
    interval: int = doc(0, "Save every N steps (0 = only at the end and on a signal).", bounds=">= 0")
    keep_last: int = doc(2, "Checkpoints kept.", bounds=">= 1")
    resume: str = doc("auto", "auto = the newest checkpoint in the run dir that verifies (a corrupted newer one "
                              "is skipped, named on stderr); never; or a checkpoint path (verified whole before "
                              "any model is built).")
    save_on_signal: bool = doc(True, "SIGTERM/SIGUSR1 save at the next safe point, then exit cleanly.")
    format: Literal["distributed", "per_rank"] = doc(
        "distributed", "Policy/critic state: Megatron distributed checkpoint (resume under another layout) "
        "or one torch file per rank (resume under the same layout only).")
    hf_every: int = doc(0, "Also write the policy as an HF model directory into <run_dir>/hf/step_N every N steps "
                           "(0 = never; `sao export` makes one from any checkpoint).", bounds=">= 0")

    def check(self, p: str) -> None:
        require(self.keep_last >= 1, f"{p}.keep_last", f"{self.keep_last} < 1", "keep at least 1")
        text_rules.one_line(f"{p}.resume", self.resume, empty_ok=False)
        check_bounds(self, p)


@dataclass
class LoggingConfig:
    wandb: bool = doc(True, "Log to wandb (offline unless WANDB_API_KEY is set or wandb_mode says online).")
    wandb_project: str = doc("sao-megatron", "wandb project.")
    wandb_mode: Literal["auto", "offline", "online", "disabled"] = doc("auto", "auto = online only with an API key.")
    wandb_entity: str = doc("", "wandb entity (team or user) the run goes to; '' = the API key's default.")
    wandb_group: str = doc("", "wandb group (runs of one experiment side by side); '' = none.")
    wandb_tags: list = doc([], "wandb tags, each 1-64 characters (wandb's limit, wandb_settings.py).")
    wandb_notes: str = doc("", "wandb notes: a longer description of the run.")
    tensorboard: bool = doc(False, "Also write TensorBoard event files into <run_dir>/tensorboard (beside metrics.jsonl).")
    console: bool = doc(True, "Console progress bar.")
    plot: bool = doc(True, "Write curves.png (reward, value loss, clip fractions) at the end.")

    def check(self, p: str) -> None:
        text_rules.matches(f"{p}.wandb_project", self.wandb_project, text_rules.WANDB_PROJECT,
                           "a wandb project name (1-128 characters, none of / \\ # ? % :)")
        text_rules.check_wandb_text(self, p)
        check_bounds(self, p)


@dataclass
class EvalConfig:
    interval: int = doc(0, "Evaluate every N steps (0 = off).", bounds=">= 0")
    datasets: list = doc([], "Held-out sets: jsonl files with 'prompt' and 'answer', 'task:NAME', or an agentic "
                             "benchmark: 'code_repair:FILE.jsonl', 'tool_task:NAME' (the python-tool agent on a "
                             "built-in task) (docs/evaluation.md).")
    k: int = doc(4, "Samples per problem for avg@k / pass@k.", bounds=">= 1")
    max_problems: int = doc(0, "Evaluate at most this many problems per set (0 = all).", bounds=">= 0")
    max_turns: int = doc(8, "Agentic sets: model turns per episode (each up to rollout.max_new_tokens tokens).",
                         bounds=">= 1")
    max_episode_tokens: int = doc(2048, "Agentic sets: response tokens per episode, actions and tool outputs "
                                        "together; one tool output is cut to max_episode_tokens / max_turns "
                                        "(at least one token per turn: >= max_turns).")
    temperature: Optional[float] = doc(None, "Eval sampling temperature (None = rollout.temperature; 0 is not "
                                             "allowed: pass@k needs k different samples).", bounds="> 0")
    top_p: Optional[float] = doc(None, "Eval nucleus p (None = rollout.top_p).", bounds="(0, 1]")
    max_new_tokens: Optional[int] = doc(None, "Eval response tokens per turn (None = rollout.max_new_tokens).",
                                        bounds=">= 1")
    agentic_evals: dict = doc({}, "Your own agentic benchmarks: {scheme = 'pkg.mod:Class'} (an AgenticEval with "
                                  "from_source), then eval.datasets = ['scheme:ARG'] (docs/evaluation.md).")

    def check(self, p: str) -> None:
        require(self.max_episode_tokens >= self.max_turns, f"{p}.max_episode_tokens",
                 f"{self.max_episode_tokens} leaves no token per turn for {self.max_turns} turns",
                 "use at least eval.max_turns tokens (e.g. 2048)")
        for scheme, path in self.agentic_evals.items():
            require(isinstance(scheme, str) and scheme.isidentifier() and scheme != "task", f"{p}.agentic_evals",
                     f"{scheme!r} is not a scheme name", "use a Python identifier other than 'task' as the key")
            require(isinstance(path, str) and ":" in path, f"{p}.agentic_evals", f"{scheme} = {path!r} is not "
                     "an import path", "write it as 'package.module:Class'")
            text_rules.import_path(f"{p}.agentic_evals", path)
        for source in self.datasets:
            require(isinstance(source, str), f"{p}.datasets", f"{source!r} is not a string",
                     "list file paths or 'task:NAME' strings")
            text_rules.one_line(f"{p}.datasets", source, empty_ok=False)
        check_bounds(self, p)


@dataclass
class LaunchConfig:
    nodes: int = doc(1, "Nodes in the allocation.", bounds=">= 1")
    trainer_nodes: int = doc(0, "Nodes for trainer ranks (0 = nodes - rollout_nodes).", bounds=">= 0")
    rollout_nodes: int = doc(0, "Nodes for rollout engines (0 = colocated with the trainer).", bounds=">= 0")
    gpus_per_node: int = doc(8, "GPUs per node (0 on CPU).", bounds=">= 0")
    partition: str = doc("", "slurm partition (letters, digits, '_', '.', '-', ','; nothing else reaches the script).")
    account: str = doc("", "slurm account.")
    time_limit: str = doc("04:00:00", "slurm --time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS.")
    requeue: bool = doc(True, "Requeue on preemption (checkpoint on SIGUSR1 first).")
    signal_seconds: int = doc(120, "Seconds before the time limit that slurm sends SIGUSR1 (below the time limit "
                                  "and slurm's 65535).", bounds=">= 0")
    container: str = doc("", "Container image for srun --container-image ('' = none).")
    env: dict = doc({}, "Extra environment for every rank (e.g. NCCL settings).")
    python: str = doc("python", "Python interpreter on the nodes.")

    def check(self, p: str) -> None:
        require(self.rollout_nodes < self.nodes or self.rollout_nodes == 0, f"{p}.rollout_nodes",
                 f"{self.rollout_nodes} leaves no trainer node of {self.nodes}", "lower it or add nodes")
        text_rules.check_launch_text(self, p)
        check_bounds(self, p)


@dataclass
class SFTConfig:
    steps: int = doc(0, "Supervised warm-start steps (`sao sft`); > 0 makes `sao train` run them first and start RL "
                        "from the result.", bounds=">= 0")
    lr: float = doc(1e-3, "SFT learning rate.", bounds="> 0")
    batch_size: int = doc(32, "Prompt/response pairs per SFT step.", bounds=">= 1")
    task: str = doc("", "Built-in task whose reference solutions to train on ('' = rollout.task).")
    dataset: str = doc("", "jsonl of {'prompt', 'response'} pairs (instead of a task's solutions).")
    prompt_key: str = doc("prompt", "sft.dataset field holding the prompt (a string or chat messages).")
    response_key: str = doc("response", "sft.dataset field holding the reference response.")
    output: str = doc("", "Directory of the SFT model (HF format); '' = <run_dir>/sft_model.")

    def check(self, p: str) -> None:
        require(self.steps >= 0, f"{p}.steps", f"{self.steps} < 0", "use 0 (off) or more")
        require(self.lr > 0, f"{p}.lr", f"{self.lr} <= 0", "use 1e-3 for the tiny model")
        require(self.batch_size >= 1, f"{p}.batch_size", f"{self.batch_size} < 1", "use 1 or more")
        for name in ("task", "dataset", "output", "prompt_key", "response_key"):
            text_rules.one_line(f"{p}.{name}", getattr(self, name))
        for name in ("prompt_key", "response_key"):
            require(bool(getattr(self, name).strip()), f"{p}.{name}", "is empty", "name a field of sft.dataset's rows")
        require(self.prompt_key != self.response_key, f"{p}.response_key", "is the prompt field too",
                 "name the field with the reference response")
        check_bounds(self, p)


SECTIONS = {
    "run": RunConfig, "model": ModelConfig, "parallel": ParallelConfig, "rollout": RolloutConfig,
    "algorithm": AlgorithmConfig, "critic": CriticConfig, "weight_sync": WeightSyncConfig,
    "checkpoint": CheckpointConfig, "logging": LoggingConfig, "eval": EvalConfig, "launch": LaunchConfig,
    "sft": SFTConfig,
}

# Keys a recipe may still carry from an older release: "unknown key" would leave the reader without the
# replacement, so the error names it (recipe.py).
REMOVED_KEYS = {
    "rollout.update_mode": "remove it and set weight_sync.pause_mode (it was always overridden by that field)",
}


def field_docs(cls) -> dict:
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}
