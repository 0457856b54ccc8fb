"""Run the same RL steps under several parallel layouts in one process group and compare them.

Used by `sao doctor`, bench/parallel.py and the distributed tests. Every rank runs
``run_layouts(model_dir, layouts)``: for each layout it tears down Megatron's groups, builds the
policy, loads the same HF weights, computes logprobs on fixed micro-batches and takes `steps`
optimizer steps with a fixed token-mean policy-gradient loss. DP ranks take micro-batches
``i::dp``; every micro-batch carries the global token count, so all layouts compute the same
gradient as one rank running every micro-batch.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from sao_megatron.core.records import LossOutputs, TrainBatch

LAYOUTS = {
    "single": dict(),
    "tp2": dict(tp=2),
    "ep2": dict(ep=2),
    "ep2_allgather": dict(ep=2, dispatcher="allgather"),
    "pp2": dict(pp=2),
    "pp2_uneven": dict(pp=2, last_stage_layers=1),   # Megatron's uneven last stage: 3 + 1 layers
    "vpp2": dict(pp=2, vpp=2),
    "dp2": dict(),
    "dp2_distopt": dict(distributed_optimizer=True),
    "tp2xep2": dict(tp=2, ep=2),
    "tp2xpp2": dict(tp=2, pp=2),
}


def make_recipe(model_dir: str | Path, layout: dict, lr: float = 1e-3, micro_batch_tokens: int = 4096):
    """A policy recipe for the tiny model under `layout` (tp, pp, vpp, ep, dispatcher)."""
    from sao_megatron.core.config.recipe import Recipe

    recipe = Recipe()
    recipe.model.path = str(model_dir)
    recipe.algorithm.lr = lr
    recipe.critic.lr = lr
    recipe.parallel = replace(recipe.parallel, micro_batch_tokens=micro_batch_tokens, **layout)
    if recipe.parallel.distributed_optimizer:   # its distributed checkpoint needs CUDA; these runs never save
        recipe.checkpoint.format = "per_rank"
    return recipe


def fixed_batches(vocab: int, num: int = 4, rows: int = 2, seq: int = 16, seed: int = 0, num_layers: int = 0,
                  top_k: int = 0, num_experts: int = 8, dense_layers: int = 0) -> list[TrainBatch]:
    """Deterministic micro-batches with ragged lengths, masks, advantages and (with num_layers) random
    routes laid out as SGLang returns them: one column per hidden layer, the first `dense_layers`
    columns zero."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num):
        lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=gen)
        tokens = torch.randint(7, vocab, (rows, seq), generator=gen)
        pos = torch.arange(seq).unsqueeze(0)
        real = pos < lengths.unsqueeze(1)
        tokens = torch.where(real, tokens, torch.zeros_like(tokens))
        mask = (real & (pos >= 3)).float()
        adv = torch.randn(rows, seq, generator=gen) * mask
        zeros = torch.zeros(rows, seq)
        routes = None
        if num_layers:
            routes = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(rows * seq * num_layers)])
            routes = routes.reshape(rows, seq, num_layers, top_k).int()
            routes[:, :, :dense_layers] = 0
        batches.append(TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, rollout_logprobs=zeros,
                                  advantages=adv, returns=zeros.clone(), weight_versions=torch.zeros(rows, seq, dtype=torch.long),
                                  routed_experts=routes))
    total = float(sum(b.loss_mask.sum() for b in batches))
    return [replace(b, global_num_tokens=total) for b in batches]


def policy_gradient_loss(batch: TrainBatch, outputs: dict) -> LossOutputs:
    """-(sum A*logp + 0.01 * sum H) / N over action tokens (N = global action tokens of the step)."""
    mask = batch.loss_mask
    pg = -(outputs["logp"] * batch.advantages * mask).sum() / batch.global_num_tokens
    ent = (outputs["entropy"] * mask).sum() / batch.global_num_tokens
    return LossOutputs(pg - 0.01 * ent, {"pg_loss": pg.detach(), "entropy": ent.detach()})


def value_loss(batch: TrainBatch, outputs: dict) -> LossOutputs:
    """0.5 * sum mask * (V - R)^2 / N (masked MSE, N = global action tokens)."""
    err = (outputs["values"] - batch.returns) * batch.loss_mask
    loss = 0.5 * (err ** 2).sum() / batch.global_num_tokens
    return LossOutputs(loss, {"value_loss": loss.detach()})


def dp_shard(batches: list[TrainBatch]) -> list[TrainBatch]:
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    if len(batches) % dp:
        raise ValueError(f"{len(batches)} micro-batches do not split over dp={dp}")
    return batches[rank::dp]


def run_layout(model_dir: str | Path, layout: dict, hf_tensors: dict, batches: list[TrainBatch],
               steps: int = 2, role: str = "policy") -> dict:
    """Logprobs (or values) and per-step metrics of one layout on this rank."""
    from .distributed import teardown_model_parallel
    from .rl_model import RLModel

    teardown_model_parallel()
    try:
        model = RLModel.build(make_recipe(model_dir, layout), role)
        model.load_hf_state_dict(hf_tensors)
        if role == "policy":
            first = [lp for lp, _ in model.compute_logprobs(batches)]
        else:
            first = model.compute_values(batches)
        loss = policy_gradient_loss if role == "policy" else value_loss
        local = dp_shard(batches)
        metrics, times = [], []
        for _ in range(steps):
            start = time.perf_counter()
            metrics.append(model.train_step(local, loss))
            times.append(time.perf_counter() - start)
        timed = times[1:] or times  # the first step pays one-time allocation: a warm-up when steps > 1
        return {"first": first, "steps": metrics, "seconds_per_step": sum(timed) / max(len(timed), 1)}
    finally:
        teardown_model_parallel()


def run_layouts(model_dir: str | Path, names: list[str], steps: int = 2, num_batches: int = 4,
                seq: int = 16, layouts: Optional[dict] = None, routes: bool = False) -> dict[str, dict]:
    """Every layout in `names` (keys of LAYOUTS or `layouts`) on this process group.

    routes=True gives every micro-batch random engine routes to replay: layouts then agree only if
    replay slices tokens and layers correctly (a wrong slice picks other experts: logprobs move ~1e-1).
    """
    from safetensors.torch import load_file

    from .model_build import read_hf_config
    from .specs import arch_shape

    table = layouts or LAYOUTS
    hf_tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    hf = read_hf_config(model_dir)
    shape = arch_shape(hf)
    batches = fixed_batches(shape.vocab_size, num=num_batches, seq=seq,
                            num_layers=shape.num_layers if routes else 0, top_k=shape.top_k,
                            num_experts=shape.num_experts, dense_layers=shape.first_dense_layers)
    return {name: run_layout(model_dir, table[name], hf_tensors, batches, steps) for name in names}


def check_fit(model_dir: str | Path, names: list[str], world_size: int, layouts: Optional[dict] = None) -> None:
    """Every named layout against the model and the world before any rank starts (ParallelDims.validate);
    a LayoutError names the layout, the recipe field and the fix."""
    from sao_megatron.core.dims import LayoutError, ParallelDims

    from .model_build import read_hf_config
    from .specs import arch_shape

    shape = arch_shape(read_hf_config(model_dir))
    for name in names:
        par = make_recipe(model_dir, (layouts or LAYOUTS)[name]).parallel
        try:
            ParallelDims.from_config(par, world_size).validate(world_size, shape)
        except LayoutError as err:
            raise LayoutError(err.field, f"layout {name!r}: {err.problem}", err.fix) from None


def compare(result: dict, reference: dict) -> dict[str, float]:
    """Max |delta| of logprobs, loss and grad norm between a layout's result and the reference."""
    logp = max(float((a - b).abs().max()) for a, b in zip(result["first"], reference["first"]))
    loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(result["steps"], reference["steps"]))
    grad = max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(result["steps"], reference["steps"]))
    out = {"logp": logp, "loss": loss, "grad_norm": grad}
    if "route_agreement" in reference["steps"][0]:
        out["route_agreement"] = max(abs(a["route_agreement"] - b["route_agreement"])
                                     for a, b in zip(result["steps"], reference["steps"]))
    return out


def layouts_for_world(world_size: int) -> list[str]:
    """The layouts that fit `world_size` ranks (single is the reference and needs 1)."""
    if world_size == 1:
        return ["single"]
    if world_size == 2:
        return ["tp2", "ep2", "ep2_allgather", "pp2", "vpp2", "dp2"]
    if world_size == 4:
        return ["tp2xep2", "tp2xpp2", "tp2", "ep2", "pp2", "vpp2"]
    return []
