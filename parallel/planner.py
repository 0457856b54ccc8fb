"""Memory per GPU of a run (trainer, critic, rollout engine) for a layout, and layouts that fit.

Everything here is arithmetic on an HF config dict (parallel/model_shapes.py counts the parameters);
nothing touches a GPU. The formulas, their sources and what they leave out are in docs/cluster.md
("Memory planner"). In short, per trainer GPU:

- weights     = params_on_rank · b_w                (b_w = 2 for bf16, 4 for fp32)
- gradients   = trainable_on_rank · 4               (Megatron keeps fp32 main grads)
- optimizer   = trainable_on_rank · b_opt / shard   (b_opt = 12: fp32 master + Adam m, v; 8 when the
                params are fp32 already; shard = dp·cp for dense, expert-dp for experts under the
                distributed optimizer, else 1; 0 on the GPU with optimizer CPU offload)
- activations = in_flight_micro_batches · Σ_layers bytes_per_token · tokens_on_rank + logits
- reserve     = a fixed RUNTIME_RESERVE_GIB for CUDA context, NCCL buffers and fragmentation.

Sharding on rank (Megatron-Core): attention, dense MLP, shared experts, embedding and head split
over TP; routed experts over EP·ETP; norms, routers and the DSA indexer replicated; layers over PP
(first stages get ceil(L/pp) layers, the last stage the remainder, as ``--decoder-last-pipeline-
num-layers`` does); the embedding on the first stage, final norm and head on the last.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from .model_shapes import (LayerParams, all_layers, count_parameters, embedding_params, has_qk_norm, head_params,
                           is_mla, is_moe_layer, num_experts)

GIB = 1024 ** 3
RUNTIME_RESERVE_GIB = 3.0


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float  # what torch.cuda.mem_get_info reports as total on an idle device


GPUS = {"h100": GpuSpec("h100", 79.6), "h200": GpuSpec("h200", 139.8)}


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    vpp: int = 1

    def dp(self, world: int) -> int:
        return world // (self.tp * self.pp * self.cp)

    def expert_dp(self, world: int) -> int:
        return world // (self.pp * self.ep * self.etp)

    def short(self) -> str:
        return f"tp{self.tp} pp{self.pp} cp{self.cp} ep{self.ep} etp{self.etp}" + (f" vpp{self.vpp}" if self.vpp > 1 else "")


def layout_problem(cfg: dict, layout: Layout, world: int) -> str:
    """Why `layout` cannot run this model on `world` ranks ('' when it can)."""
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    base = layout.tp * layout.pp * layout.cp
    if world % base:
        return f"tp·pp·cp = {base} does not divide {world} ranks"
    if heads % layout.tp or (not is_mla(cfg) and kv % layout.tp):
        return f"tp={layout.tp} does not divide {heads} heads / {kv} kv heads"
    experts = num_experts(cfg)
    if experts and experts % layout.ep:
        return f"ep={layout.ep} does not divide {experts} experts"
    if (world // layout.pp) % (layout.ep * layout.etp):
        return f"ep·etp = {layout.ep * layout.etp} does not divide the {world // layout.pp} ranks of a stage"
    if min(stage_layer_counts(cfg["num_hidden_layers"], layout.pp * layout.vpp)) < 1:
        return f"pp·vpp = {layout.pp * layout.vpp} leaves a stage without layers ({cfg['num_hidden_layers']} layers)"
    return ""


def stage_layer_counts(num_layers: int, stages: int) -> list[int]:
    """ceil(L/stages) layers on every stage but the last, which takes the rest (78 over 4 -> 20,20,20,18)."""
    first = math.ceil(num_layers / stages)
    return [first] * (stages - 1) + [num_layers - first * (stages - 1)]


def stage_ranges(num_layers: int, pp: int, vpp: int = 1) -> list[list[int]]:
    """Layer indices held by each pipeline rank (virtual chunks interleave: chunk c goes to rank c % pp)."""
    counts = stage_layer_counts(num_layers, pp * vpp)
    starts = list(itertools.accumulate([0] + counts))
    ranks: list[list[int]] = [[] for _ in range(pp)]
    for chunk, count in enumerate(counts):
        ranks[chunk % pp].extend(range(starts[chunk], starts[chunk] + count))
    return ranks


# ------------------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds, by kind. Dense and expert parts are per rank (already divided)."""

    tp_split: float      # attention, dense MLP, shared experts, embedding/head: 1/tp on each rank
    replicated: float    # norms, routers, DSA indexer: whole on every rank of the stage
    expert: float        # routed experts: 1/(ep·etp) on each rank
    frozen_split: float = 0.0       # part of tp_split that is not trained (critic with frozen attention)
    frozen_replicated: float = 0.0  # part of replicated that is not trained (the DSA indexer)

    @property
    def total(self) -> float:
        return self.tp_split + self.replicated + self.expert

    @property
    def frozen_dense(self) -> float:
        return self.frozen_split + self.frozen_replicated


def _layer_split(p: LayerParams, trainable: str) -> tuple[int, int, int, int, int]:
    """(tp-split, replicated, expert, frozen tp-split, frozen replicated) parameters of one layer."""
    split = p.attention + p.dense_mlp + p.shared_experts + p.mtp_extra
    repl = p.attention_norms + p.indexer + p.router + p.norms
    if trainable != "moe_only":
        return split, repl, p.routed_experts, 0, 0
    # Critic with frozen attention (SAO): attention, indexer and dense MLPs get no grads.
    return split, repl, p.routed_experts, p.attention + p.dense_mlp + p.mtp_extra, p.indexer


def rank_params(cfg: dict, layout: Layout, stage: int, trainable: str = "all", value_head: bool = False) -> RankParams:
    """Parameters on one rank of pipeline stage `stage`. trainable: 'all' | 'moe_only' (critic)."""
    layers = all_layers(cfg)
    sums = [0, 0, 0, 0, 0]  # split, replicated, expert, frozen split, frozen replicated
    for index in stage_ranges(cfg["num_hidden_layers"], layout.pp, layout.vpp)[stage]:
        sums = [a + b for a, b in zip(sums, _layer_split(layers[index], trainable))]
    split, repl, expert, frozen_split, frozen_repl = sums
    if stage == 0:
        split += embedding_params(cfg)
        frozen_split += embedding_params(cfg) if trainable == "moe_only" else 0
    if stage == layout.pp - 1:
        repl += cfg["hidden_size"]  # final norm
        if value_head:
            repl += cfg["hidden_size"] + 1
        else:
            split += head_params(cfg)
    return RankParams(split / layout.tp, float(repl), expert / (layout.ep * layout.etp), frozen_split / layout.tp,
                      float(frozen_repl))


def model_total_from_ranks(cfg: dict, layout: Layout) -> float:
    """Σ over stages of one copy of each shard: must equal count_parameters(cfg).total."""
    total = 0.0
    for stage in range(layout.pp):
        p = rank_params(cfg, layout, stage)
        total += p.tp_split * layout.tp + p.replicated + p.expert * layout.ep * layout.etp
    return total


# ------------------------------------------------------------------------------------- activations


def layer_activation_elems(cfg: dict, moe: bool, layout: Layout, recompute: str, kernels: str = "te",
                           seq_len: int = 0) -> float:
    """Stored activation elements per token of the micro-batch for one layer on one rank.

    Tokens are split by cp; h-sized tensors by tp (sequence parallel), head-sized ones by tp (heads).
    kernels 'te' (Transformer Engine spec, the GPU path): flash attention stores no s² score matrix,
    fused SwiGLU. kernels 'local' (Megatron-Core's local spec, what runs on CPU): see
    _local_layer_elems; `seq_len` is the padded row length its unfused attention scores span.
    'selective' recomputes the core attention (Megatron's default recompute_modules, which
    parallel/rl_model.py keeps): under flash attention that stores nothing less. 'full' keeps only the
    layer input (plus one layer's working set, added by the caller).
    """
    h, tp = cfg["hidden_size"], layout.tp
    if recompute == "full":
        return h / tp / layout.cp
    if kernels == "local":
        return _local_layer_elems(cfg, moe, layout, recompute, seq_len or 1)
    q, kv, out, latent = _attention_dims(cfg)
    attn = 2 * h / tp + (q + 2 * kv + out) / tp + latent
    if cfg.get("index_n_heads"):
        attn += cfg["index_n_heads"] * cfg["index_head_dim"] + cfg["index_head_dim"]
    if moe:
        fm, k = cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
        fs = (cfg.get("n_shared_experts") or 0) * fm
        mlp = 2 * h / tp + 3 * fs / tp
        # Each token goes to k experts; balanced routing gives each rank as many copies as it sends.
        mlp += k / tp * (layout.etp * h + 3 * fm)
    else:
        mlp = 2 * h / tp + 3 * cfg["intermediate_size"] / tp
    return (attn + mlp) / layout.cp


def _local_layer_elems(cfg: dict, moe: bool, layout: Layout, recompute: str, seq_len: int) -> float:
    """Elements per token autograd saves in one layer of Megatron-Core's local spec (unfused kernels).

    Counted tensor by tensor from what each module saves for backward (bench/parallel.py measures
    the same bytes with saved-tensor hooks); terms under 1% of a layer are left out:
    - each RMSNorm: its input and normalised output (2 per width), per-row rstd; rotary: q and k;
    - unfused core attention: q, k and v repeated to every query head, and the softmax
      probabilities, heads/tp · seq_len per token (no flash attention); 'selective' recompute keeps
      only its inputs q, k, v instead;
    - every linear: its input;
    - SequentialMLP experts, per token copy: fc1 input h, fc1 output 2·fm, SiLU input and output
      2·fm, the router-probability product fm, fc2 input fm, the probability (6·fm + h + 1);
      dense MLPs and shared experts the same without the probability product (5·f).
    """
    h, tp = cfg["hidden_size"], layout.tp
    q, kv, out, latent = _attention_dims(cfg)
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    attn = 2 * h / tp + h / tp + (q + kv) / tp + latent          # input norm, qkv input, rotary
    if has_qk_norm(cfg):
        attn += (2 * (q + kv) + nh + nkv) / tp
    if recompute == "selective":
        attn += (q + 2 * kv) / tp
    else:
        attn += (2 * q + out) / tp + nh * seq_len / tp
    attn += out / tp                                             # linear_proj input
    if cfg.get("index_n_heads"):
        attn += cfg["index_n_heads"] * cfg["index_head_dim"] + cfg["index_head_dim"]
    mlp = 2 * h / tp                                             # pre-MLP norm
    if moe:
        fm, k = cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
        fs = (cfg.get("n_shared_experts") or 0) * fm
        mlp += h / tp + 5 * fs / tp                              # router input, shared experts
        mlp += k / tp * (layout.etp * h + 6 * fm + layout.etp)
    else:
        mlp += h / tp + 5 * cfg["intermediate_size"] / tp
    return (attn + mlp) / layout.cp


def _attention_dims(cfg: dict) -> tuple[int, int, int, int]:
    """(q width, k (= v-side) width, attention output width, replicated latent width) per token."""
    nh = cfg["num_attention_heads"]
    if is_mla(cfg):
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        v = cfg["v_head_dim"]
        # k and v are expanded per head for attention; MLA's latents are not split over TP.
        return nh * qk, nh * (qk + v) // 2, nh * v, cfg["q_lora_rank"] + cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    nkv = cfg.get("num_key_value_heads", nh)
    return nh * hd, nkv * hd, nh * hd, 0


def in_flight_micro_batches(layout: Layout, stage: int) -> float:
    """1F1B keeps pp - stage micro-batches alive; interleaving adds (pp-1)/(pp·vpp) on stage 0
    (Narayanan et al. 2021; Korthikanti et al. 2022, eq. for the interleaved schedule)."""
    if layout.vpp > 1:
        return layout.pp * (1 + (layout.pp - 1) / (layout.pp * layout.vpp))
    return float(layout.pp - stage)


def activation_bytes(cfg: dict, layout: Layout, stage: int, tokens: int, recompute: str, act_bytes: int,
                     value_head: bool = False, kernels: str = "te", seq_len: int = 0) -> float:
    """Activation memory of one rank of `stage` for micro-batches of `tokens` tokens (before CP).
    seq_len: the padded row length (local kernels only; 0 = one row of `tokens`)."""
    moe_flags = [is_moe_layer(cfg, i) for i in range(cfg["num_hidden_layers"])]
    layers = stage_ranges(cfg["num_hidden_layers"], layout.pp, layout.vpp)[stage]

    def elems(i: int, mode: str) -> float:
        return layer_activation_elems(cfg, moe_flags[i], layout, mode, kernels, seq_len or tokens)

    per_mb = sum(elems(i, recompute) for i in layers) * tokens * act_bytes
    total = per_mb * in_flight_micro_batches(layout, stage)
    if recompute == "full" and layers:  # one layer is rebuilt at a time during backward
        total += max(elems(i, "none") for i in layers) * tokens * act_bytes
    if stage == layout.pp - 1 and not value_head:
        # fp32 logits for log-probs plus their bf16 copy, vocab split over TP.
        total += tokens / layout.cp * cfg["vocab_size"] / layout.tp * (4 + act_bytes)
    return total


# ------------------------------------------------------------------------------------- trainer memory


@dataclass(frozen=True)
class TrainOptions:
    dtype: str = "bf16"               # parameter dtype of the trainer
    recompute: str = "none"           # none | selective | full
    micro_batch_tokens: int = 4096
    kernels: str = "te"               # te (Transformer Engine, GPUs) | local (Megatron local spec, CPU)
    seq_len: int = 0                  # padded row length for local kernels' attention scores (0 = one row)
    distributed_optimizer: bool = True
    optimizer_offload: bool = False   # Adam state and fp32 master on the host (CPU Adam)


@dataclass(frozen=True)
class ModelMemory:
    """Bytes on the worst rank (the stage with the largest sum) of one trained model."""

    stage: int
    params: float
    weights: float
    gradients: float
    optimizer: float
    activations: float
    host: float = 0.0  # optimizer state kept in host memory (CPU offload)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def model_memory(cfg: dict, layout: Layout, world: int, opts: TrainOptions, critic: bool = False,
                 freeze_attention: bool = True) -> ModelMemory:
    """Per-GPU memory of the policy (critic=False) or the critic (value head; SAO frozen attention)."""
    trainable = "moe_only" if critic and freeze_attention else "all"
    per_stage = [_stage_memory(cfg, layout, world, opts, stage, trainable, critic) for stage in range(layout.pp)]
    return max(per_stage, key=lambda m: m.total)


def _stage_memory(cfg, layout, world, opts, stage, trainable, critic) -> ModelMemory:
    p = rank_params(cfg, layout, stage, trainable, value_head=critic)
    b_w = 4 if opts.dtype == "fp32" else 2
    dense_trainable = p.tp_split + p.replicated - p.frozen_dense
    b_opt = 8 if opts.dtype == "fp32" else 12
    dense_shard = layout.dp(world) * layout.cp if opts.distributed_optimizer else 1
    expert_shard = layout.expert_dp(world) if opts.distributed_optimizer else 1
    optimizer = b_opt * (dense_trainable / dense_shard + p.expert / expert_shard)
    acts = activation_bytes(cfg, layout, stage, opts.micro_batch_tokens, opts.recompute, b_w, value_head=critic,
                            kernels=opts.kernels, seq_len=opts.seq_len)
    on_gpu, host = (0.0, optimizer) if opts.optimizer_offload else (optimizer, 0.0)
    return ModelMemory(stage, p.total, p.total * b_w, (dense_trainable + p.expert) * 4, on_gpu, acts, host)


# ------------------------------------------------------------------------------------- rollout engine


@dataclass(frozen=True)
class EngineOptions:
    tp: int = 1                 # GPUs per engine (SGLang --tp-size)
    ep: int = 1                 # --ep-size (experts are split over all tp GPUs either way)
    dp_attention: int = 0       # --dp-size with --enable-dp-attention (0 = off)
    mem_fraction: float = 0.7   # --mem-fraction-static
    fp8_weights: bool = False
    kv_dtype: str = "bf16"      # bf16 | fp8
    include_mtp: bool = False   # speculative decoding with the MTP layer


@dataclass(frozen=True)
class EngineMemory:
    weights: float              # bytes per GPU
    static_pool: float          # mem_fraction · capacity: weights + KV cache
    kv_pool: float              # bytes per GPU left for KV
    kv_bytes_per_token: float   # per GPU, all layers
    tokens_per_engine: float    # KV capacity of one engine

    @property
    def fits(self) -> bool:
        return self.kv_pool > 0


def engine_memory(cfg: dict, opts: EngineOptions, capacity: float) -> EngineMemory:
    """SGLang memory: weights split over tp (experts) and the attention-tp group (the rest);
    the static pool (mem_fraction of the GPU) holds weights and the KV cache."""
    attn_tp = opts.tp // max(opts.dp_attention, 1)
    counts = count_parameters(cfg, include_mtp=opts.include_mtp)
    linear_bytes = 1 if opts.fp8_weights else 2
    other = counts.total - counts.routed_experts - 2 * embedding_params(cfg)
    weights = (counts.routed_experts * linear_bytes / opts.tp + other * linear_bytes / attn_tp
               + 2 * embedding_params(cfg) * 2 / attn_tp)
    kv_token = kv_bytes_per_token(cfg, attn_tp, 1 if opts.kv_dtype == "fp8" else 2)
    static = opts.mem_fraction * capacity
    kv_pool = static - weights
    groups = opts.tp // attn_tp
    return EngineMemory(weights, static, kv_pool, kv_token, max(kv_pool, 0) / kv_token * groups)


def kv_bytes_per_token(cfg: dict, attn_tp: int, kv_bytes: int) -> float:
    """KV cache per token on one GPU: MLA caches the latent (kv_lora + rope) whole on every attention-TP
    rank; GQA caches k and v of ceil(nkv / attn_tp) heads; the DSA indexer adds an fp8 key + fp32 scale."""
    layers = cfg["num_hidden_layers"]
    if is_mla(cfg):
        per_layer = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * kv_bytes
    else:
        nh = cfg["num_attention_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
        per_layer = 2 * math.ceil(cfg.get("num_key_value_heads", nh) / attn_tp) * hd * kv_bytes
    if cfg.get("index_head_dim"):
        per_layer += cfg["index_head_dim"] + 4
    return per_layer * layers


# ------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanInput:
    """What the planner needs, independent of how it was read (recipe + CLI)."""

    cfg: dict
    gpus: int
    gpu: GpuSpec
    gpus_per_node: int
    rollout_gpus: int            # 0 = colocated (engines share the trainer GPUs, phases alternate)
    layout: Layout
    train: TrainOptions
    engine: EngineOptions
    critic: bool = True
    freeze_attention: bool = True
    critic_placement: str = "shared"  # shared: both resident; swap: only the model being updated
    sequence_tokens: int = 0          # prompt + response budget of one sample
    max_in_flight: int = 0            # requests in flight over all engines


@dataclass
class Plan:
    inp: PlanInput
    world: int
    problem: str = ""
    policy: ModelMemory | None = None
    critic: ModelMemory | None = None
    engine: EngineMemory | None = None
    trainer_total: float = 0.0
    peak: float = 0.0
    host_per_gpu: float = 0.0  # host memory the trainer needs per GPU (offloaded optimizer, swapped model)
    notes: list[str] = field(default_factory=list)

    @property
    def capacity(self) -> float:
        return self.inp.gpu.memory_gib * GIB

    @property
    def fits(self) -> bool:
        return not self.problem and self.peak <= self.capacity and self.engine is not None and \
            self.engine.fits and self.kv_ok

    @property
    def engines(self) -> int:
        return max((self.inp.rollout_gpus or self.inp.gpus) // self.inp.engine.tp, 0)

    @property
    def kv_ok(self) -> bool:
        """An engine must hold at least one whole sequence; less than the in-flight demand only queues
        requests (a throughput note, see `kv_demand`), so it does not decide the fit."""
        if self.engine is None or not self.engines:
            return False
        return self.engine.tokens_per_engine >= self.inp.sequence_tokens

    @property
    def kv_demand(self) -> float:
        """KV tokens one engine needs to keep all of rollout.max_in_flight requests at full length."""
        return self.inp.max_in_flight * self.inp.sequence_tokens / max(self.engines, 1)


def make_plan(inp: PlanInput) -> Plan:
    """Memory per GPU of trainer and engine for `inp.layout`; `plan.fits` says whether it fits."""
    world = inp.gpus - inp.rollout_gpus
    plan = Plan(inp, world)
    if world < 1:
        plan.problem = f"rollout uses {inp.rollout_gpus} of {inp.gpus} GPUs, none are left for the trainer"
        return plan
    plan.problem = layout_problem(inp.cfg, inp.layout, world)
    if inp.engine.tp < 1 or (inp.rollout_gpus or inp.gpus) % inp.engine.tp:
        plan.problem = plan.problem or f"engine tp {inp.engine.tp} does not divide the {inp.rollout_gpus or inp.gpus} rollout GPUs"
    if plan.problem:
        return plan
    plan.policy = model_memory(inp.cfg, inp.layout, world, inp.train)
    if inp.critic:
        plan.critic = model_memory(inp.cfg, inp.layout, world, inp.train, critic=True,
                                   freeze_attention=inp.freeze_attention)
    plan.engine = engine_memory(inp.cfg, inp.engine, plan.capacity)
    plan.trainer_total = _trainer_peak(plan) + RUNTIME_RESERVE_GIB * GIB
    plan.host_per_gpu = _host_bytes(plan)
    engine_peak = plan.engine.static_pool + RUNTIME_RESERVE_GIB * GIB
    # Colocated engines and trainers alternate (each offloads while the other runs): the peak is the max.
    plan.peak = max(plan.trainer_total, engine_peak) if inp.rollout_gpus == 0 else plan.trainer_total
    if inp.rollout_gpus == 0:
        plan.notes.append("colocated: engines and trainers share GPUs and must offload in turn")
    if plan.engine.tokens_per_engine < plan.kv_demand:
        plan.notes.append(f"KV cache holds {plan.engine.tokens_per_engine / 1e6:.2f}M tokens per engine, "
                          f"{plan.kv_demand / 1e6:.2f}M are in flight at full length: requests will queue")
    return plan


def _trainer_peak(plan: Plan) -> float:
    policy, critic = plan.policy, plan.critic
    if critic is None:
        return policy.total
    if plan.inp.critic_placement == "swap":
        return max(policy.total, critic.total)
    return policy.total + critic.total


def _host_bytes(plan: Plan) -> float:
    """Offloaded optimizer state, plus under swap the parked model's weights, grads and GPU optimizer state."""
    models = [m for m in (plan.policy, plan.critic) if m is not None]
    host = sum(m.host for m in models)
    if plan.inp.critic_placement == "swap" and len(models) == 2:
        host += min(m.total - m.activations for m in models)
    return host


def search_layouts(inp: PlanInput, limit: int = 5) -> list[Plan]:
    """Layouts (tp, pp, cp, ep; etp = 1) that fit, fewest model-parallel ranks first, then least memory."""
    cfg, world = inp.cfg, inp.gpus - inp.rollout_gpus
    experts = num_experts(cfg) or 1
    tps = [t for t in (1, 2, 4, 8) if t <= max(inp.gpus_per_node, 1)]
    pps = [p for p in (1, 2, 4, 8, 16) if p <= cfg["num_hidden_layers"]]
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64, 128, 256) if e <= experts]
    fitting = []
    for tp, pp, cp, ep in itertools.product(tps, pps, (1, 2, 4, 8), eps):
        layout = Layout(tp=tp, pp=pp, cp=cp, ep=ep, etp=1)
        if layout_problem(cfg, layout, max(world, 1)):
            continue
        plan = make_plan(replace(inp, layout=layout))
        if plan.fits:
            fitting.append(plan)
    fitting.sort(key=lambda p: (p.inp.layout.tp * p.inp.layout.pp * p.inp.layout.cp, p.inp.layout.pp, p.peak))
    return fitting[:limit]


# ------------------------------------------------------------------------------------- from a recipe


def model_config_of(recipe) -> dict:
    """The HF config the plan uses: model.shape_preset if set, else model.path/config.json."""
    import json
    from pathlib import Path

    from sao_megatron.config import ConfigError

    from .model_shapes import get_shape

    if recipe.model.shape_preset:
        try:
            return get_shape(recipe.model.shape_preset)
        except KeyError as err:
            raise ConfigError("model.shape_preset", str(err.args[0]), "pick a name from parallel/model_shapes.py") from None
    config = Path(recipe.model.path) / "config.json"
    if not config.is_file():
        raise ConfigError("model.path", f"{config} does not exist and model.shape_preset is empty",
                          "set model.shape_preset (e.g. 'glm5-744b-a40b') or point model.path at a local model")
    return json.loads(config.read_text())


def plan_input_from_recipe(recipe, gpus: int = 0, gpu: str = "h100", **options) -> PlanInput:
    """PlanInput from a loaded recipe. gpus = 0 takes launch.nodes · launch.gpus_per_node.
    `options` sets PlanInput/TrainOptions/EngineOptions fields the recipe has no key for
    (critic_placement, kv_dtype, include_mtp) or overrides the recipe's (optimizer_offload,
    critic_placement: parallel.optimizer_offload and critic.placement)."""
    par, roll, launch = recipe.parallel, recipe.rollout, recipe.launch
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is unknown; use one of {', '.join(GPUS)}")
    per_node = launch.gpus_per_node or 1
    gpus = gpus or launch.nodes * per_node
    train = TrainOptions(dtype=recipe.model.dtype, recompute=recipe.model.recompute,
                         micro_batch_tokens=par.micro_batch_tokens, distributed_optimizer=par.distributed_optimizer,
                         kernels="local" if recipe.model.transformer_impl == "local" else "te",
                         seq_len=min(roll.max_prompt_len + roll.max_new_tokens, par.micro_batch_tokens),
                         optimizer_offload=par.optimizer_offload if options.get("optimizer_offload") is None
                         else options.pop("optimizer_offload"))
    options.pop("optimizer_offload", None)
    engine = EngineOptions(tp=roll.engine_tp, ep=roll.engine_ep, dp_attention=roll.engine_dp_attention,
                           mem_fraction=roll.mem_fraction, fp8_weights=roll.engine_fp8,
                           kv_dtype=options.pop("kv_dtype", "bf16"), include_mtp=options.pop("include_mtp", False))
    layout = Layout(tp=par.tp, pp=par.pp, ep=par.ep, etp=par.etp or par.tp, cp=par.cp, vpp=par.vpp)
    return PlanInput(cfg=model_config_of(recipe), gpus=gpus, gpu=GPUS[gpu], gpus_per_node=per_node,
                     rollout_gpus=launch.rollout_nodes * per_node, layout=layout, train=train, engine=engine,
                     critic=recipe.critic.enabled, freeze_attention=recipe.critic.freeze_attention,
                     sequence_tokens=roll.max_prompt_len + roll.max_new_tokens, max_in_flight=roll.max_in_flight,
                     **{"critic_placement": recipe.critic.placement, **options})


OPTION_LADDER = [  # tried in order when the recipe's own settings fit no layout
    {},
    {"critic_placement": "swap"},
    {"optimizer_offload": True},
    {"optimizer_offload": True, "critic_placement": "swap"},
]


def with_options(inp: PlanInput, options: dict) -> PlanInput:
    train = replace(inp.train, optimizer_offload=options.get("optimizer_offload", inp.train.optimizer_offload))
    return replace(inp, train=train, critic_placement=options.get("critic_placement", inp.critic_placement))
