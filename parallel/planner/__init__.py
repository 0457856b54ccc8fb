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

One module per concern: layouts.py (what can run, which layers each stage holds), params.py
(parameters on a rank), activations.py, trainer.py (one trained model's memory), engine.py (SGLang's),
plan.py (the fit decision and the layout search), from_recipe.py (what `sao plan` reads),
fp8_memory.py (what TE FP8 adds and saves), hardware.py (the GPU table and efficiencies), timing.py
(seconds per step), sync_time.py (weight-sync seconds per transport, the sender's memory),
validation.py (the published figures the time model is held against).
"""
from .activations import activation_bytes, in_flight_micro_batches, layer_activation_elems
from .engine import EngineMemory, EngineOptions, engine_memory, kv_bytes_per_token
from .from_recipe import OPTION_LADDER, model_config_of, plan_input_from_recipe, with_options
from .fp8_memory import FP8_WEIGHT_COPY_BYTES, fp8_activation_saving, fp8_weight_copy_bytes
from .hardware import GPUS, GpuSpec, gpu_spec
from .layouts import Layout, layout_problem, stage_layer_counts, stage_ranges
from .params import RankParams, model_total_from_ranks, rank_params
from .plan import GIB, RUNTIME_RESERVE_GIB, Plan, PlanInput, make_plan, search_layouts
from .sync_time import TRANSPORTS, SenderMemory, SyncTime, sender_memory, sync_time
from .timing import StepTime, Workload, step_time, workload_from_recipe
from .trainer import ModelMemory, TrainOptions, model_memory

__all__ = [
    "activation_bytes", "in_flight_micro_batches", "layer_activation_elems",
    "EngineMemory", "EngineOptions", "engine_memory", "kv_bytes_per_token",
    "OPTION_LADDER", "model_config_of", "plan_input_from_recipe", "with_options",
    "FP8_WEIGHT_COPY_BYTES", "fp8_activation_saving", "fp8_weight_copy_bytes",
    "GPUS", "GpuSpec", "gpu_spec", "Layout", "layout_problem", "stage_layer_counts", "stage_ranges",
    "RankParams", "model_total_from_ranks", "rank_params",
    "GIB", "RUNTIME_RESERVE_GIB", "Plan", "PlanInput", "make_plan", "search_layouts",
    "ModelMemory", "TrainOptions", "model_memory",
    "TRANSPORTS", "SenderMemory", "SyncTime", "sender_memory", "sync_time",
    "StepTime", "Workload", "step_time", "workload_from_recipe",
]
