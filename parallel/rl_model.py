"""RLModel: the policy or critic Megatron model of this rank, as the trainer sees it.

    model = RLModel.build(recipe, "policy")       # or "critic", or "reference" (forward only, no optimizer)
    model.load_hf_state_dict(hf_tensors)          # full HF state dict -> this rank's shards
    [(logp, entropy), ...] = model.compute_logprobs(micro_batches)
    metrics = model.train_step(micro_batches, loss_fn)
    for name, tensor in model.export_hf(): ...

Batches are this DP rank's micro-batches (sao_megatron/trainer/batching.py splits by the token budget);
results are replicated on every TP/PP rank of the replica. Conventions follow records.py: value
and logprob at position t belong to token t and come from the hidden state at t-1; position 0 is 0.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from sao_megatron.core.dims import ParallelDims
from sao_megatron.core.records import LossOutputs, TrainBatch

from . import model_build, specs
from .context_parallel import ContextParallel
from .hf_mapping import HFMapping
from .logprobs import shift_to_tokens, token_logprobs_from_logits
from .offload import ModelParking
from .optimizer import LrSchedule, OptimSettings, build_optimizer, current_lr, guarded_step, loss_is_finite, wrap_ddp
from .packing import PackedLayout, seq_multiple
from .indexer_replay import IndexerReplayer
from .routing_replay import RouteReplayer
from .schedule import configure_per_token_loss, run_schedule
from .stage_outputs import broadcast_from_last_stage, reduce_step_metrics
from .weights import export_hf_tensors, load_hf_tensors

ROLES = ("policy", "critic", "reference")


class RLModel:
    def __init__(self, role: str, recipe, hf_config: dict, dims: ParallelDims, config, chunks, optimizer,
                 clip_grad: float):
        self.role, self.recipe, self.hf_config, self.dims = role, recipe, hf_config, dims
        self.config, self.chunks, self.optimizer, self.clip_grad = config, chunks, optimizer, clip_grad
        self.shape = specs.arch_shape(hf_config)
        self.seq_multiple = seq_multiple(dims.tp, dims.sequence_parallel, dims.cp, recipe.model.fp8)
        self.cp = ContextParallel.from_megatron()
        self.temperature = recipe.rollout.temperature   # pi is the engine's sampling distribution
        # packed micro-batches: THD (per-sample attention: TE's, or packed_attention.py's on the local spec),
        # except MLA on the local spec, whose core attention (mla_attention.py) takes a block-diagonal mask
        local_mla = bool(getattr(config, "multi_latent_attention", False)) and \
            not specs.use_transformer_engine(recipe.model.transformer_impl)
        self.packed_form = "mask" if local_mla else "thd"
        self.replayer = RouteReplayer([c.module for c in chunks], config.num_layers,
                                      self.shape.top_k, dims.sequence_parallel)
        self.indexers = IndexerReplayer([c.module for c in chunks], config.num_layers,
                                        int(hf_config.get("index_topk") or 0))
        self.parking = ModelParking(self)
        self.lr = None if optimizer is None else LrSchedule(optimizer, _optim_settings(recipe, role, config))

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def build(cls, recipe, role: str) -> "RLModel":
        """Model + optimizer of this rank under recipe.parallel (initialises process groups if needed)."""
        if role not in ROLES:
            raise ValueError(f"RLModel role {role!r}; use one of {', '.join(ROLES)}")
        _refuse_gpu_only_options(recipe)
        hf = model_build.read_hf_config(recipe.model.path)
        te = specs.use_transformer_engine(recipe.model.transformer_impl)
        if recipe.parallel.pack_sequences and hf.get("index_topk") and te:
            raise ValueError("parallel.pack_sequences with a DSA model on Transformer Engine: our sparse attention "
                             "takes no THD input (packing runs on the local spec only); fix: set "
                             "parallel.pack_sequences = false")
        dims = _setup_groups(recipe, specs.arch_shape(hf))
        dtype = torch.bfloat16 if recipe.model.dtype == "bf16" else torch.float32
        config = specs.transformer_config(hf, dims, dtype=dtype, dispatcher=recipe.parallel.dispatcher,
                                          routing_replay=True, fp8=recipe.model.fp8,
                                          impl=recipe.model.transformer_impl)
        if recipe.model.recompute != "none":
            config.recompute_granularity = recipe.model.recompute
            if recipe.model.recompute == "full":
                config.recompute_method, config.recompute_num_layers = "uniform", 1
        configure_per_token_loss(config)
        config.dsa_indexer_loss_coeff = recipe.model.indexer_loss_coeff if role == "policy" else 0.0
        critic = role == "critic"
        chunks = model_build.build_chunks(hf, config, critic, recipe.model.transformer_impl, recipe.model.max_seq_len)
        if critic and recipe.critic.freeze_attention:
            model_build.freeze_attention(chunks)
        if role == "reference":   # forward only: no gradient buffers (DDP holds none for frozen parameters)
            for chunk in chunks:
                chunk.requires_grad_(False)
        ddp = wrap_ddp(chunks, config, recipe.parallel.distributed_optimizer)
        optimizer = None if role == "reference" else build_optimizer(ddp, _optim_settings(recipe, role, config))
        return cls(role, recipe, hf, dims, config, ddp, optimizer, recipe.algorithm.grad_clip)

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The unwrapped GPTModel chunks of this rank."""
        return [c.module for c in self.chunks]

    # -- weights -----------------------------------------------------------------------------------
    def _mapping(self) -> HFMapping:
        return HFMapping.from_hf_config(self.hf_config)

    def load_hf_state_dict(self, hf_tensors: Mapping[str, torch.Tensor]) -> None:
        """Full HF (on-disk names) state dict -> this rank's shards. The critic skips lm_head and keeps
        its value head; with critic.init_from_policy = false the critic keeps its random init."""
        self.parking.unpark()
        if self.role == "critic" and not self.recipe.critic.init_from_policy:
            return
        skip = ("output_layer.",) if self.role == "critic" else ()
        for module in self.modules:
            load_hf_tensors(module, self._mapping(), hf_tensors, skip)

    def export_hf(self, scope: str = "all", snapshot: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, gathered over TP/EP (and PP with scope="all"), yielded on every rank
        in the same order; scope="stage" yields only this pipeline stage's tensors, on its ranks;
        scope="shares" yields (name, tensor, (i, n)) for the tensors this rank holds after its TP
        gather, as holder i of n (parallel/weights.py), for shard writes from every rank.
        The critic yields its backbone and ``value_head.weight``. snapshot=False yields views of the live
        parameters where a tensor needs no conversion: only for a consumer done with them before the
        next optimizer step (the broadcast sender, rollout/weights/plan.py)."""
        self.parking.unpark()
        yield from export_hf_tensors(self.modules, self._mapping(), value_head=self.role == "critic", scope=scope,
                                     snapshot=snapshot)

    # -- forward -----------------------------------------------------------------------------------
    def _before_forward(self, chunk_index: int, batch: TrainBatch) -> None:
        self.replayer.set_routes(chunk_index, batch.routed_experts)
        self.indexers.set_topk(chunk_index, batch.indexer_topk)

    def _fill_pipeline(self, batches: list[TrainBatch]) -> list[TrainBatch]:
        """With VPP Megatron needs a multiple of pp micro-batches, and more than its first rank's warm-up:
        pad with copies whose loss_mask and advantages are zero (no loss, no gradient, no route replay);
        their outputs are dropped. Megatron-Core 0.16.1's interleaved schedule deadlocks (both ranks wait in
        p2p, seen on gloo with pp2 vpp2 and 2 micro-batches) when every micro-batch of the first rank is
        a warm-up one: its warm-up is 2 (pp - 1) + (vpp - 1) pp of the nb * vpp forwards
        (schedules.py get_pp_rank_microbatches), so nb must exceed that divided by vpp."""
        pp, vpp = self.dims.pp, self.dims.vpp
        if vpp == 1:
            return batches
        warmup = 2 * (pp - 1) + (vpp - 1) * pp
        needed = max(len(batches), warmup // vpp + 1)
        extra = -(-needed // pp) * pp - len(batches)
        if extra == 0:
            return batches
        last = batches[-1]
        zero = torch.zeros_like(last.loss_mask)
        # the filler keeps the last batch's DSA selections: a "shared" indexer layer on a stage apart from
        # its full layer has no other way to choose keys
        filler = replace(last, loss_mask=zero, advantages=zero, routed_experts=None, sample_uids=[])
        return batches + [filler] * extra

    def _forward_only(self, batches: list[TrainBatch], on_output) -> list:
        self.indexers.check_batches(batches)
        for chunk in self.chunks:
            chunk.eval()
        try:
            with torch.no_grad():
                store = run_schedule(self.chunks, self._fill_pipeline(batches), self.seq_multiple, on_output,
                                     self._before_forward, forward_only=True, cp=self.cp,
                                     packed_form=self.packed_form)
            return store[:len(batches)]
        finally:
            self.replayer.clear()
            self.indexers.clear()

    def _token_logprobs(self, batch: TrainBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's logits (padded, CP-local) -> logp/entropy [rows, seq] of the batch's tokens
        under softmax(logits / rollout.temperature), in sequence order on every CP rank."""
        seq = batch.tokens.shape[1]
        if batch.packed:   # [1, packed width] -> the batch's rows (a row's first token reads no sample of its own)
            layout = PackedLayout.of(batch, self.seq_multiple)
            logp, ent = token_logprobs_from_logits(logits, layout.pack(batch.tokens), self.shape.vocab_size,
                                                   temperature=self.temperature, cp=self.cp)
            return layout.unpack(logp, seq, first_zero=True), layout.unpack(ent, seq, first_zero=True)
        padded = torch.nn.functional.pad(batch.tokens, (0, logits.shape[1] * self.cp.size - seq))  # as the model saw
        logp, ent = token_logprobs_from_logits(logits, padded, self.shape.vocab_size, temperature=self.temperature,
                                               cp=self.cp)
        return logp[:, :seq], ent[:, :seq]

    def _values(self, batch: TrainBatch, raw: torch.Tensor) -> torch.Tensor:
        """Value head output (padded, CP-local) [rows, local, 1] -> values [rows, seq]; value at t from
        the hidden state at t-1, 0 at t = 0."""
        values = shift_to_tokens(self.cp.gather(raw.squeeze(-1).float()))
        if batch.packed:
            return PackedLayout.of(batch, self.seq_multiple).unpack(values, batch.tokens.shape[1], first_zero=True)
        return values[:, :batch.tokens.shape[1]]

    def compute_logprobs(self, batches: list[TrainBatch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per batch (logp [rows, seq], entropy [rows, seq]) at rollout.temperature; no grad; replayed
        routes when given."""
        self.parking.unpark()
        self._require_role(("policy", "reference"), "compute_logprobs")

        def on_output(i, batch, logits):
            logp, ent = self._token_logprobs(batch, logits)
            return logp.sum(), {"logp": logp, "entropy": ent}

        store = self._forward_only(batches, on_output)
        out = broadcast_from_last_stage(store, [b.tokens.shape for b in batches], ("logp", "entropy"))
        return [(o["logp"], o["entropy"]) for o in out]

    def compute_values(self, batches: list[TrainBatch]) -> list[torch.Tensor]:
        """Critic values [rows, seq] per batch (value at t from the hidden state at t-1; 0 at t=0)."""
        self.parking.unpark()
        self._require_role(("critic",), "compute_values")

        def on_output(i, batch, raw):
            values = self._values(batch, raw)
            return values.sum(), {"values": values}

        store = self._forward_only(batches, on_output)
        return [o["values"] for o in broadcast_from_last_stage(store, [b.tokens.shape for b in batches], ("values",))]

    # -- training ----------------------------------------------------------------------------------
    def train_step(self, batches: list[TrainBatch], loss_fn: Callable[[TrainBatch, dict], LossOutputs]) -> dict[str, float]:
        """Forward-backward over the micro-batches, then one optimizer step (skipped if non-finite) at the
        learning rate of the next step of the schedule (a skipped step still uses up its place)."""
        self.parking.unpark()
        self._require_role(("policy", "critic"), "train_step")
        self.indexers.check_batches(batches)
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.replayer.agreement.reset()
        self.indexers.agreement.reset()
        on_output = self._policy_outputs(loss_fn) if self.role == "policy" else self._critic_outputs(loss_fn)
        try:
            store = run_schedule(self.chunks, self._fill_pipeline(batches), self.seq_multiple, on_output,
                                 self._before_forward, cp=self.cp, packed_form=self.packed_form)
        finally:
            self.replayer.clear()
            self.indexers.clear()
        metrics = reduce_step_metrics(store)
        finite = loss_is_finite(metrics.get("loss", 0.0))
        self.lr.advance()
        applied, grad_norm = guarded_step(self.optimizer, self.clip_grad, finite)
        metrics.update(grad_norm=grad_norm, lr=current_lr(self.optimizer), skipped=0.0 if applied else 1.0)
        if any(b.routed_experts is not None for b in batches):
            agreement = self.replayer.agreement.reduced()
            if agreement is not None:
                metrics["route_agreement"] = agreement
        if any(b.indexer_topk is not None for b in batches):
            agreement = self.indexers.agreement.reduced()
            if agreement is not None:
                metrics["indexer_agreement"] = agreement
        return metrics

    def _policy_outputs(self, loss_fn):
        def on_output(i, batch, logits):
            logp, ent = self._token_logprobs(batch, logits)
            return _call_loss(loss_fn, batch, {"logp": logp, "entropy": ent})
        return on_output

    def _critic_outputs(self, loss_fn):
        def on_output(i, batch, raw):
            return _call_loss(loss_fn, batch, {"values": self._values(batch, raw)})
        return on_output

    def _require_role(self, roles: tuple, what: str) -> None:
        if self.role not in roles:
            raise TypeError(f"RLModel.{what} needs the {' or '.join(roles)} model; this is the {self.role}")

    # -- swap (critic.placement = swap) ----------------------------------------------------------------
    def park(self) -> None:
        """Move weights, grad buffers and optimizer state to host memory (see parallel/offload.py);
        any later call that needs the model brings it back first."""
        self.parking.park()

    def unpark(self) -> None:
        self.parking.unpark()

    # -- checkpoint ----------------------------------------------------------------------------------
    @property
    def distributed_checkpoint(self) -> bool:
        """Save through Megatron dist_checkpointing (checkpoint.format = distributed)."""
        return self.recipe.checkpoint.format == "distributed"

    def _sharded_state(self, loading: bool, optimizer: bool = True) -> dict:
        model = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(self.chunks)}
        if not optimizer:
            return model
        return {**model, "optimizer": self.optimizer.sharded_state_dict(model, is_loading=loading)}

    def _optimizer_chain(self) -> list:
        """Megatron builds one Adam without expert parallelism and a dense + expert chain with it."""
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    def _torch_optimizers(self) -> list:
        return [part.optimizer for part in self._optimizer_chain()]

    def _optimizer_has_state(self) -> bool:
        """False until the first optimizer step: Adam creates its moments lazily. (The policy has none
        while the critic warms up.) Megatron's loading plan asks for every moment, so a checkpoint
        saved before that step carries the weights alone and says so in sao_layout.json."""
        return any(len(s) for opt in self._torch_optimizers() for s in opt.state.values())

    def _optimizer_parts(self) -> int:
        return len(self._optimizer_chain())

    def save_distributed(self, path: Path) -> None:
        """Megatron distributed checkpoint (torch_dist) of the model and optimizer into the existing
        directory `path`: every rank writes its shards under global tensor names, so it loads under
        another TP/PP/VPP/DP layout. Collective: every rank calls it."""
        self.parking.unpark()
        import json

        from megatron.core import dist_checkpointing

        stepped = self._optimizer_has_state()
        dist_checkpointing.save(self._sharded_state(loading=False, optimizer=stepped), str(path))
        if torch.distributed.get_rank() == 0:
            (path / "sao_layout.json").write_text(json.dumps({"dims": self.dims.__dict__,
                                                               "optimizer_parts": self._optimizer_parts(),
                                                               "optimizer_state": stepped}))

    def load_distributed(self, path: Path) -> None:
        """Load a save_distributed checkpoint written under any layout with the same expert-parallel
        kind (EP = 1 or EP > 1: the optimizer's structure differs between the two)."""
        self.parking.unpark()
        import json

        from megatron.core import dist_checkpointing

        saved = json.loads((path / "sao_layout.json").read_text())
        if saved["optimizer_parts"] != self._optimizer_parts():
            raise ValueError(f"{path} holds an optimizer of {saved['optimizer_parts']} part(s) (saved with ep="
                             f"{saved['dims']['ep']}), this run builds {self._optimizer_parts()} (ep={self.dims.ep}); "
                             "fix: resume with expert parallelism on (ep > 1) or off (ep = 1) as it was saved, "
                             "or start from the weights alone through `sao convert`")
        stepped = saved.get("optimizer_state", True)
        loaded = dist_checkpointing.load(self._sharded_state(loading=True, optimizer=stepped), str(path))
        for i, chunk in enumerate(self.chunks):
            chunk.module.load_state_dict(loaded[f"model{i}"])
        if stepped:
            self.optimizer.load_state_dict(loaded["optimizer"])
        else:                                          # saved before the first step: Adam as it was then
            for opt in self._torch_optimizers():
                opt.state.clear()

    def state_dict_for_checkpoint(self) -> dict:
        """This rank's model shards and optimizer state (checkpoint.format = per_rank: same layout only)."""
        self.parking.unpark()
        return {"model": [c.module.state_dict() for c in self.chunks], "optimizer": self.optimizer.state_dict(),
                "dims": self.dims.__dict__}

    def load_checkpoint(self, state: dict) -> None:
        self.parking.unpark()
        if state.get("dims") != self.dims.__dict__:
            raise ValueError(f"checkpoint layout {state.get('dims')} differs from this run's {self.dims.__dict__}; "
                             f"resume with the same parallel layout, or save with checkpoint.format = distributed")
        for chunk, sd in zip(self.chunks, state["model"]):
            chunk.module.load_state_dict(sd)
        self.optimizer.load_state_dict(state["optimizer"])


def _optim_settings(recipe, role: str, config) -> OptimSettings:
    """The role's optimizer and learning-rate schedule; the schedule spans the run's optimizer steps: the
    policy's run.num_steps x algorithm.mini_batches, the critic's (pretrain + warm-up + run.num_steps) x
    critic.updates_per_step (trainer/state.py counts the warm-up the same way)."""
    algo, critic = recipe.algorithm, recipe.critic
    if role == "critic":
        steps = (critic.pretrain_steps + critic.warmup_steps + recipe.run.num_steps) * critic.updates_per_step
    else:
        steps = recipe.run.num_steps * algo.mini_batches
    lr = critic if role == "critic" else algo
    return OptimSettings(lr=lr.lr, weight_decay=algo.weight_decay, beta1=algo.adam_beta1, beta2=algo.adam_beta2,
                         clip_grad=algo.grad_clip, bf16=config.params_dtype == torch.bfloat16,
                         distributed=recipe.parallel.distributed_optimizer, offload=recipe.parallel.optimizer_offload,
                         lr_schedule=lr.lr_schedule, lr_warmup_steps=lr.lr_warmup_steps, lr_min=lr.lr_min,
                         total_steps=max(steps, 1))


def _refuse_gpu_only_options(recipe) -> None:
    """One-line errors, before any process group, for options that need CUDA."""
    if torch.cuda.is_available():
        return
    if recipe.parallel.dispatcher == "flex":
        from .fusions import check_dispatcher
        check_dispatcher("flex", False, recipe.parallel.tp, recipe.parallel.ep, cuda=False, deep_ep=False)
    if recipe.parallel.cp > 1:
        raise ValueError(f"parallel.cp = {recipe.parallel.cp} needs CUDA and Transformer Engine (Megatron's local "
                         "attention asserts cp == 1); fix: set parallel.cp = 1 on CPU")
    if recipe.parallel.optimizer_offload:
        raise ValueError("parallel.optimizer_offload needs CUDA (it moves Adam state from the GPU to the host); "
                         "fix: set parallel.optimizer_offload = false on CPU")
    if recipe.parallel.distributed_optimizer and recipe.checkpoint.format == "distributed":
        raise ValueError("parallel.distributed_optimizer with checkpoint.format = 'distributed' needs CUDA: "
                         "megatron-core 0.16.1 saves distributed-optimizer state wrongly on CPU; "
                         "fix: set checkpoint.format = 'per_rank' (same-layout resume) on CPU")


def _setup_groups(recipe, shape) -> ParallelDims:
    from megatron.core import parallel_state

    from .distributed import init_distributed, init_model_parallel, single_process_port

    single_process_port()
    init_distributed("auto")
    world = torch.distributed.get_world_size()
    dims = ParallelDims.from_config(recipe.parallel, world).validate(world, shape)
    if not parallel_state.model_parallel_is_initialized():
        init_model_parallel(dims, seed=recipe.run.seed)
        return dims
    live = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size())
    if live != (dims.tp, dims.pp, dims.ep):
        raise ValueError(f"Megatron groups already exist with tp,pp,ep={live} but this model wants "
                         f"{(dims.tp, dims.pp, dims.ep)}; policy and critic share one layout "
                         f"(call parallel.distributed.teardown_model_parallel() to switch)")
    return dims


def _call_loss(loss_fn, batch: TrainBatch, outputs: dict) -> tuple[torch.Tensor, dict]:
    result = loss_fn(batch, outputs)
    metrics = {k: float(v) for k, v in result.metrics.items()}
    metrics["loss"] = float(result.loss.detach())
    return result.loss, metrics
