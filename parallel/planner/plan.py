"""The plan: trainer and engine memory for one layout, whether it fits, and a search over layouts."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from sao_megatron.core.dims import ParallelDims

from ..model_shapes import num_experts
from .engine import EngineMemory, EngineOptions, engine_memory
from .layouts import GpuSpec, Layout, layout_problem
from .sync_time import SenderMemory, sender_memory
from .trainer import ModelMemory, TrainOptions, model_memory

GIB = 1024 ** 3
RUNTIME_RESERVE_GIB = 3.0


@dataclass(frozen=True)
class PlanInput:
    """What the planner needs, independent of how it was read (recipe + CLI)."""

    cfg: dict
    gpus: int
    gpu: GpuSpec
    gpus_per_node: int
    rollout_gpus: int            # 0 = colocated (engines share the trainer GPUs, phases alternate)
    layout: ParallelDims
    train: TrainOptions
    engine: EngineOptions
    critic: bool = True
    freeze_attention: bool = True
    critic_placement: str = "shared"  # shared: both resident; swap: only the model being updated
    sequence_tokens: int = 0          # prompt + response budget of one sample
    max_in_flight: int = 0            # requests in flight over all engines
    bucket_bytes: float = 64 * 2 ** 20  # weight_sync.bucket_mb: the weight-sync sender's bucket
    max_sender_bytes: float = 32768 * 2 ** 20  # weight_sync.max_sender_mb: the bound on the sender's memory
    sync_method: str = "broadcast"    # weight_sync.method: what the sender holds (sender_memory)
    shard_senders: int = 2            # weight_sync.shard_senders: shard_writes lanes
    reference: bool = False           # algorithm.kl_coef > 0: a frozen reference copy, parked in host memory when idle


@dataclass
class Plan:
    inp: PlanInput
    world: int
    problem: str = ""
    policy: ModelMemory | None = None
    critic: ModelMemory | None = None
    reference: float = 0.0     # the KL reference's weights (bytes per GPU), on the GPU only for its logprob pass
    engine: EngineMemory | None = None
    trainer_total: float = 0.0
    peak: float = 0.0
    host_per_gpu: float = 0.0  # host memory the trainer needs per GPU (offloaded optimizer, swapped model)
    sender: SenderMemory | None = None  # the weight-sync sender's extra memory (worst stage's sender)
    sync_peak: float = 0.0     # sender GPU during a sync: resident model(s) without activations + sender + reserve
    notes: list[str] = field(default_factory=list)

    @property
    def capacity(self) -> float:
        return self.inp.gpu.memory_gib * GIB

    @property
    def fits(self) -> bool:
        return not self.problem and self.peak <= self.capacity and self.engine is not None and \
            self.engine.fits and self.kv_ok and self.sync_peak <= self.capacity

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
    if inp.reference:   # forward only: weights, no gradients or optimizer (parallel/rl_model.py "reference")
        plan.reference = plan.policy.weights
        plan.notes.append(f"KL reference: {plan.reference / GIB:.1f} GiB of weights per GPU, on the GPU only for "
                          "its logprob pass, parked in host memory otherwise")
    plan.engine = engine_memory(inp.cfg, inp.engine, plan.capacity)
    plan.trainer_total = _trainer_peak(plan) + RUNTIME_RESERVE_GIB * GIB
    plan.host_per_gpu = _host_bytes(plan)
    _plan_sender(plan)
    engine_peak = plan.engine.static_pool + RUNTIME_RESERVE_GIB * GIB
    # Colocated engines and trainers alternate (each offloads while the other runs): the peak is the max.
    plan.peak = max(plan.trainer_total, engine_peak) if inp.rollout_gpus == 0 else plan.trainer_total
    if inp.rollout_gpus == 0:
        plan.notes.append("colocated: engines and trainers share GPUs and must offload in turn")
    if plan.engine.tokens_per_engine < plan.kv_demand:
        plan.notes.append(f"KV cache holds {plan.engine.tokens_per_engine / 1e6:.2f}M tokens per engine, "
                          f"{plan.kv_demand / 1e6:.2f}M are in flight at full length: requests will queue")
    if inp.engine.fp8_weights and inp.gpu.name in FP8_REFUSED_GPUS:
        plan.notes.append(f"FP8 engines on {inp.gpu.name} are refused at launch (SGLang 0.5.23 re-quantises their "
                          "scales to UE8M0 at load, docs/engines.md): plan with rollout.engine_fp8=false")
    return plan


FP8_REFUSED_GPUS = ("b200",)   # planner GPUs of the Blackwell kind (rollout/engines/sglang_launcher.py check_fp8_engine_gpu)


def _plan_sender(plan: Plan) -> None:
    """The sync runs after the update: activations are freed, the policy (and under `shared` the critic)
    stay resident, and the sender adds what the streamed export and its buckets hold (sender_memory)."""
    inp = plan.inp
    plan.sender = sender_memory(inp, inp.bucket_bytes, inp.max_sender_bytes)
    resident = [plan.policy] + ([plan.critic] if plan.critic and inp.critic_placement == "shared" else [])
    plan.sync_peak = sum(m.total - m.activations for m in resident) + plan.sender.total + RUNTIME_RESERVE_GIB * GIB
    if plan.sender.refused:
        plan.notes.append(f"weight_sync.max_sender_mb = {inp.max_sender_bytes / 2 ** 20:g} is below what the sender "
                          f"needs ({plan.sender.need / 2 ** 20:.0f} MiB): the recipe check refuses it; raise it "
                          f"or lower weight_sync.bucket_mb")
    if plan.sync_peak > plan.capacity:
        plan.notes.append(f"weight-sync sender needs {plan.sync_peak / GIB:.1f} GiB during a sync: lower "
                          f"weight_sync.bucket_mb or raise tp/pp/ep (the resident model scales with the layout)")


def _trainer_peak(plan: Plan) -> float:
    return max(_training_peak(plan), _reference_pass_peak(plan))


def _training_peak(plan: Plan) -> float:
    policy, critic = plan.policy, plan.critic
    if critic is None:
        return policy.total
    if plan.inp.critic_placement == "swap":
        return max(policy.total, critic.total)
    return policy.total + critic.total


def _reference_pass_peak(plan: Plan) -> float:
    """The reference's logprob pass: its weights and a forward pass's activations (at most the policy's
    training activations) beside the models that stay resident, without their activations."""
    if not plan.reference:
        return 0.0
    resident = [plan.policy] + ([plan.critic] if plan.critic and plan.inp.critic_placement == "shared" else [])
    return sum(m.total - m.activations for m in resident) + plan.reference + plan.policy.activations


def _host_bytes(plan: Plan) -> float:
    """Offloaded optimizer state, plus under swap the parked model's weights, grads and GPU optimizer state."""
    models = [m for m in (plan.policy, plan.critic) if m is not None]
    host = sum(m.host for m in models)
    if plan.inp.critic_placement == "swap" and len(models) == 2:
        host += min(m.total - m.activations for m in models)
    return host + plan.reference   # the parked KL reference


def search_layouts(inp: PlanInput, limit: int = 5) -> list[Plan]:
    """Layouts (tp, pp, cp, ep; etp = 1) that fit, fewest model-parallel ranks first, then least memory."""
    cfg, world = inp.cfg, inp.gpus - inp.rollout_gpus
    experts = num_experts(cfg) or 1
    tps = [t for t in (1, 2, 4, 8) if t <= max(inp.gpus_per_node, 1)]
    pps = [p for p in (1, 2, 4, 8, 16) if p <= cfg["num_hidden_layers"]]
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64, 128, 256) if e <= experts]
    cps = (1,) if cfg.get("index_topk") else (1, 2, 4, 8)   # DSA selects over the whole sequence: no CP
    fitting = []
    for tp, pp, cp, ep in itertools.product(tps, pps, cps, eps):
        layout = Layout(tp=tp, pp=pp, cp=cp, ep=ep, etp=1)
        if layout_problem(cfg, layout, max(world, 1)):
            continue
        plan = make_plan(replace(inp, layout=layout))
        if plan.fits:
            fitting.append(plan)
    fitting.sort(key=lambda p: (p.inp.layout.tp * p.inp.layout.pp * p.inp.layout.cp, p.inp.layout.pp, p.peak))
    return fitting[:limit]
