"""Seconds per step: rollout (decode roofline), train (FLOPs / rate), weight sync, and their overlap.

Formulas (docs/cluster.md, "Step time", says where each number comes from):
- decode step of one engine = max(bytes read per GPU / (HBM · DECODE_HBM_EFF), FLOPs / (GPUs · peak ·
  PREFILL_MFU)) + the MoE all-to-all of every MoE layer. Bytes read per GPU: the dense weights of the
  GPU, the fraction of its experts a batch of B sequences touches (1 - (1 - k/E)^B: B = 1 reads the
  active parameters only, a large batch nearly all), and the KV of its sequences at the mean context
  (DSA reads the indexer keys of the whole context and the latents of the top-k tokens only).
- rollout of a step = batch · response / (engines · B / decode step) + prefill; a synchronous step
  also waits for its longest sample: + (max_new_tokens - response) decode steps at batch 1.
- train = forward FLOPs per token · tokens · passes / (GPUs · bf16 peak · TRAIN_MFU [· FP8 speed-up]); for DSA
  models with the attention dense, as the trainer computes it (masked), plus the indexer's scoring
  · (1 + pipeline bubble (pp-1)/(vpp · micro-batches)); passes: policy 3 (+1 full recompute, +1 per
  logprob forward), critic 1 (values) + K · (3 [+1]); plus optimizer offload (PCIe, CPU Adam) and critic swap.
- step: asynchronous with its own rollout GPUs = max(rollout, train) + sync (the engines pause for the
  sync); otherwise (colocated, or synchronous) rollout + train + sync.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..model_shapes import (count_parameters, embedding_params, head_params, is_mla, is_moe_layer, num_experts,
                            indexer_layers)
from .engine import index_key_bytes, kv_bytes_per_token
from .hardware import (CPU_ADAM_PARAMS_PER_S, DECODE_HBM_EFF, FP8_TRAIN_SPEEDUP, PCIE_BYTES, PREFILL_MFU, TRAIN_MFU,
                       ep_all_to_all_seconds, gpu_spec)
from .sync_time import SyncTime, sync_time


@dataclass(frozen=True)
class Workload:
    """What one policy step processes (from the recipe; the mean lengths are assumptions `sao plan` prints)."""

    batch_size: int                 # samples per policy step
    prompt_tokens: float            # mean prompt length
    response_tokens: float          # mean response length
    max_new_tokens: int             # the longest response, which a synchronous step waits for
    critic_updates: int = 0         # K critic updates per policy step (0 = no critic)
    logprob_passes: int = 0         # extra policy-sized forwards: pi_old (PPO-style mini-batches), a reference model
    asynchronous: bool = True       # rollout overlaps training (SAO); False: generate, then train
    transport: str = "broadcast"
    bucket_bytes: float = 2 ** 30
    stage_parallel_gather: bool = False
    gather_experts: bool | None = None   # None: broadcast gathers the experts, sharded does not
    senders: int = 0                     # sharded: parallel senders (0 = every trainer rank, each its share)


@dataclass(frozen=True)
class StepTime:
    rollout: float
    decode_step: float              # seconds per decode step of one engine at its batch
    engine_batch: float             # sequences decoding at once per engine
    train: float
    bubble: float                   # pipeline-bubble fraction included in train
    host: float                     # optimizer offload and critic swap transfers included in train
    sync: SyncTime
    asynchronous: bool

    @property
    def serial(self) -> float:
        return self.rollout + self.train + self.sync.total

    @property
    def step(self) -> float:
        if self.asynchronous:
            return max(self.rollout, self.train) + self.sync.total
        return self.serial

    @property
    def overlap(self) -> float:
        """Seconds the asynchronous schedule hides (0 when phases run one after the other)."""
        return self.serial - self.step


def _mean_context(work: Workload) -> float:
    return work.prompt_tokens + work.response_tokens / 2


def kv_read_bytes(cfg: dict, context: float, attn_tp: int, kv_bytes: int) -> float:
    """KV bytes one GPU reads per decode step for one sequence of `context` tokens: DSA scores the index keys
    of the whole context and reads the latents of its top-k tokens only."""
    per_token = kv_bytes_per_token(cfg, attn_tp, kv_bytes)
    if not cfg.get("index_topk"):
        return per_token * context
    index = index_key_bytes(cfg)
    return index * context + (per_token - index) * min(context, cfg["index_topk"])


def decode_step_seconds(inp, batch: float, context: float) -> float:
    """One decode step of one engine with `batch` sequences at `context` tokens each."""
    cfg, eng, spec = inp.cfg, inp.engine, gpu_spec(inp.gpu.name)
    counts = count_parameters(cfg)
    wbytes = 1 if eng.fp8_weights else 2
    attn_tp = eng.tp // max(eng.dp_attention, 1)
    experts, k = num_experts(cfg), cfg.get("num_experts_per_tok", 0)
    touched = 1 - (1 - k / experts) ** batch if experts else 0.0
    other = counts.total - counts.routed_experts - embedding_params(cfg) - head_params(cfg)
    weights = (counts.routed_experts * touched / eng.tp + other / attn_tp) * wbytes + head_params(cfg) * 2 / attn_tp
    kv = kv_read_bytes(cfg, context, attn_tp, 1 if eng.kv_dtype == "fp8" else 2) * batch / (eng.tp // attn_tp)
    memory = (weights + kv) / (spec.hbm_tbps * 1e12 * DECODE_HBM_EFF)
    peak = (spec.fp8_tflops if eng.fp8_weights else spec.bf16_tflops) * 1e12
    compute = 2 * counts.active * batch / (eng.tp * peak * PREFILL_MFU)
    moe_layers = sum(is_moe_layer(cfg, i) for i in range(cfg["num_hidden_layers"]))
    return max(memory, compute) + moe_layers * ep_all_to_all_seconds(eng.ep)


def engine_batch(plan, work: Workload) -> float:
    """Sequences one engine decodes at once: the requests it is given, capped by its KV cache."""
    engines = max(plan.engines, 1)
    requests = plan.inp.max_in_flight if work.asynchronous else work.batch_size
    kv_cap = plan.engine.tokens_per_engine / (work.prompt_tokens + work.response_tokens)
    return max(min(requests / engines, kv_cap), 1.0)


def rollout_seconds(plan, work: Workload) -> tuple[float, float, float]:
    """(rollout seconds of one step, decode step seconds, engine batch)."""
    inp = plan.inp
    batch, context = engine_batch(plan, work), _mean_context(work)
    step = decode_step_seconds(inp, batch, context)
    tokens_per_s = max(plan.engines, 1) * batch / step
    seconds = work.batch_size * work.response_tokens / tokens_per_s
    spec = gpu_spec(inp.gpu.name)
    active = count_parameters(inp.cfg).active
    seconds += work.batch_size * work.prompt_tokens * 2 * active / (
        (inp.rollout_gpus or inp.gpus) * spec.bf16_tflops * 1e12 * PREFILL_MFU)
    if not work.asynchronous:
        seconds += max(work.max_new_tokens - work.response_tokens, 0) * decode_step_seconds(inp, 1, context)
    return seconds, step, batch


def forward_flops_per_token(cfg: dict, seq_len: float, sparse_attention: bool = True) -> float:
    """Forward FLOPs per token of a sequence of seq_len tokens: 2 · active parameters (the head's matmul, not
    the embedding lookup) plus causal attention, a mean of seq_len/2 earlier keys per query.

    DSA (index_topk): a query at position x attends min(x, k) keys, a mean over the sequence of
    mean_sparse_keys(seq_len, k); each layer with its own indexer also scores every earlier key,
    2 · ih · (id + 1) FLOPs per key (q_h · k in each indexer head, then the weighted sum of the heads:
    transformers modeling_glm_moe_dsa.py:185-242). `sparse_attention=False` counts the attention dense, as a
    masked implementation computes it (the trainer's: parallel/mla_attention.py)."""
    counts = count_parameters(cfg)
    flops = 2 * (counts.active - embedding_params(cfg))
    nh, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    if is_mla(cfg):
        dqk, dv = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    else:
        dqk = dv = cfg.get("head_dim") or cfg["hidden_size"] // nh
    attended = seq_len / 2
    if cfg.get("index_topk"):
        own = sum(indexer_layers(cfg))
        flops += own * 2 * cfg["index_n_heads"] * (cfg["index_head_dim"] + 1) * attended
        if sparse_attention:
            attended = mean_sparse_keys(seq_len, cfg["index_topk"])
    return flops + 2 * nh * (dqk + dv) * attended * layers


def mean_sparse_keys(seq_len: float, topk: int) -> float:
    """Mean of min(x, topk) over query positions x uniform in [0, seq_len]: seq_len/2 up to topk tokens,
    then topk - topk^2 / (2 seq_len)."""
    if seq_len <= topk:
        return seq_len / 2
    return topk - topk * topk / (2 * seq_len)


def train_seconds(plan, work: Workload) -> tuple[float, float, float]:
    """(train seconds of one step with its bubble and host transfers, bubble fraction, host seconds)."""
    inp, lay = plan.inp, plan.inp.layout
    spec = gpu_spec(inp.gpu.name)
    seq = work.prompt_tokens + work.response_tokens
    tokens = work.batch_size * seq
    fwd = forward_flops_per_token(inp.cfg, seq, sparse_attention=False) * tokens   # the trainer masks dense scores
    recompute = 1 if inp.train.recompute == "full" else 0
    passes = 3 + recompute + work.logprob_passes
    if work.critic_updates:
        passes += 1 + work.critic_updates * (3 + recompute)
    rate = plan.world * spec.bf16_tflops * 1e12 * TRAIN_MFU * (FP8_TRAIN_SPEEDUP if _fp8(inp) else 1.0)
    dp = lay.data_parallel(plan.world)
    micro = max(math.ceil(tokens / (dp * inp.train.micro_batch_tokens)), 1)
    bubble = (lay.pp - 1) / (lay.vpp * micro)
    host = host_seconds(plan, work)
    return fwd * passes / rate * (1 + bubble) + host, bubble, host


def _fp8(inp) -> bool:
    return getattr(inp.train, "fp8", "none") not in ("none", "", None)


def host_seconds(plan, work: Workload) -> float:
    """Optimizer offload (grads down, params up over PCIe, CPU Adam per node) for every update, and
    under critic swap two swaps per step (each moves one model's resident state out and the other's in)."""
    inp = plan.inp
    seconds = 0.0
    updates = [(plan.policy, 1), (plan.critic, work.critic_updates)]
    for model, count in updates:
        if model is None or not count or not model.host:
            continue
        params = model.host / 12                      # fp32 master + Adam m, v on the host
        seconds += count * (params * 6 / PCIE_BYTES + params * inp.gpus_per_node / CPU_ADAM_PARAMS_PER_S)
    if inp.critic_placement == "swap" and plan.critic is not None and work.critic_updates:
        resident = sum(m.total - m.activations for m in (plan.policy, plan.critic))
        seconds += 2 * resident / PCIE_BYTES
    return seconds


def step_time(plan, work: Workload) -> StepTime:
    """The predicted step of a plan that has a layout (plan.problem empty)."""
    rollout, decode, batch = rollout_seconds(plan, work)
    train, bubble, host = train_seconds(plan, work)
    sync = sync_time(plan.inp, work.transport, work.bucket_bytes, work.stage_parallel_gather, work.gather_experts,
                     work.senders)
    overlapped = work.asynchronous and plan.inp.rollout_gpus > 0
    return StepTime(rollout, decode, batch, train, bubble, host, sync, overlapped)


def workload_from_recipe(recipe, prompt_tokens: float | None = None, response_tokens: float | None = None,
                         transport: str | None = None) -> Workload:
    """The recipe's step. Mean lengths default to half the budgets (max_prompt_len / 2, max_new_tokens / 2);
    transport defaults to the recipe's weight_sync.method (shard_writes -> sharded), else broadcast."""
    roll, algo, sync = recipe.rollout, recipe.algorithm, recipe.weight_sync
    method = "sharded" if sync.method == "shard_writes" else "broadcast"
    return Workload(
        batch_size=roll.batch_size * (roll.n_samples_per_prompt if roll.mode == "group" else 1),
        prompt_tokens=roll.max_prompt_len / 2 if prompt_tokens is None else prompt_tokens,
        response_tokens=roll.max_new_tokens / 2 if response_tokens is None else response_tokens,
        max_new_tokens=roll.max_new_tokens,
        critic_updates=recipe.critic.updates_per_step if recipe.critic.enabled else 0,
        logprob_passes=1 if algo.loss != "dis" and algo.mini_batches > 1 else 0,
        asynchronous=roll.staleness_bound > 0,
        transport=transport or method,
        bucket_bytes=sync.bucket_mb * 2 ** 20,
        stage_parallel_gather=False)
