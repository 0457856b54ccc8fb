"""The HF transformers model behind the reference server: one batched forward per scheduler step.

Every active request owns one row ("slot") of per-layer KV slabs ``[max_batch, heads, T, dim]`` (keys
and values each as wide as the model caches them, see SlotCache); rows 0..n-1 are the active
requests (a finished request's row is refilled by the last one, so the active rows stay contiguous
and the forward uses a view, not a copy). A step feeds each row the tokens it has not cached yet
(a whole prompt, or the one token sampled last step), right-padded to the longest chunk. Row b's
token j sits at position ``len_b + j`` and attends to keys ``<= len_b + j``; padded queries attend
to key 0 only so no softmax row is empty (their outputs are discarded and their keys are never
written).

Routing capture: a forward hook on every router module (transformers 5: Qwen3-MoE's
``Qwen3MoeTopKRouter`` and GLM-4.5's ``Glm4MoeTopkRouter`` both return ``(logits, weights, indices)``)
records the top-k expert indices of every fed token. Routes have SGLang's layer axis: one column per
hidden layer, indexed by the router's global layer id (its ``layers.<L>.`` module path), and dense
layers (GLM's first ``first_k_dense_replace``, Qwen3's ``mlp_only_layers``) left zero. SGLang sizes
its capture buffer by ``num_hidden_layers`` (state_capturer/routed_experts.py:72-73), writes column
``layer_id`` (state_capturer/base.py:47-49) where TopK's layer_id is the owning layer's global index
(layers/moe/topk.py:680), and starts from zeros (base.py:38-41, 68-75).

DSA (GLM-5, DeepSeek-V3.2): each indexer selects keys by checkpoints/arch/dsa.py's rule and its
choices are captured per hidden layer (dsa_indexer.py); they are logical positions, because slot
column t holds the row's token t.
"""
from __future__ import annotations

import inspect
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoints.arch.glm5 import use_engine_latent_norm_eps

from .dsa_indexer import NOT_GIVEN, IndexerSelection

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward argument that takes a KV cache: `cache` from transformers 5.2x (`past_key_values`
    is then a deprecated alias), `past_key_values` before. An unknown keyword is swallowed by the
    model's **kwargs, so the wrong name would silently run every decode step without its cache."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise RuntimeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`; "
                       "the reference server needs a transformers causal LM with a KV cache")


class SlotCache:
    """Duck-typed transformers Cache over per-layer slabs; `plan` is set before each forward.

    Each layer's slabs take their shapes from the first tensors the model caches: ``key_states``
    ``[B, heads, S, dim]`` and ``value_states`` of possibly different heads and dim (DeepSeek-V3's
    keys are 192 wide, its values 128). transformers 5.25's multi-latent attention (glm_moe_dsa,
    deepseek_v3) caches its compressed latents instead, ``update(kv_latent [B, 1, S, kv_lora_rank],
    k_rot [B, 1, S, rope_dim])``, and its DSA indexer its own keys, ``update_indexer(k [B, S,
    index_head_dim])``: a third slab per layer. Slot column t always holds the row's token t.
    """

    is_compileable = False

    def __init__(self, num_layers: int, max_batch: int, capacity: int, device: torch.device | str = "cpu"):
        self.max_batch, self.device = max_batch, device
        self._capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.index_keys: list[torch.Tensor | None] = [None] * num_layers   # [max_batch, T, dim]
        self.rows = self.kv_len = 0
        self.write_rows = self.write_pos = self.src_rows = self.src_cols = None

    @property
    def capacity(self) -> int:
        return self._capacity

    def _slab(self, like: torch.Tensor) -> torch.Tensor:
        """A zero slab for tensors like `like` ([B, heads, S, dim] or [B, S, dim], its dtype), time on axis -2."""
        return torch.zeros((self.max_batch, *like.shape[1:-2], self._capacity, like.shape[-1]),
                           dtype=like.dtype, device=self.device)

    def _stores(self):
        return (self.keys, self.values, self.index_keys)

    def grow(self, needed: int) -> None:
        """Double the time axis until it holds `needed` positions (the slabs start small)."""
        new_cap = self._capacity
        while new_cap < needed:
            new_cap *= 2
        if new_cap == self._capacity:
            return
        for store in self._stores():
            for i, old in enumerate(store):
                if old is not None:
                    pad = old.new_zeros(*old.shape[:-2], new_cap - old.shape[-2], old.shape[-1])
                    store[i] = torch.cat([old, pad], dim=-2)
        self._capacity = new_cap

    def _write(self, store: list, layer_idx: int, states: torch.Tensor) -> torch.Tensor:
        if store[layer_idx] is None:
            store[layer_idx] = self._slab(states)
        slab = store[layer_idx]
        if slab.shape[1:-2] != states.shape[1:-2] or slab.shape[-1] != states.shape[-1]:
            raise RuntimeError(f"layer {layer_idx} cached {tuple(slab.shape)} slabs, now gets {tuple(states.shape)}")
        if states.dim() == 4:    # [B, heads, S, dim]
            slab[self.write_rows, :, self.write_pos] = states[self.src_rows, :, self.src_cols]
            return slab[: self.rows, :, : self.kv_len]
        slab[self.write_rows, self.write_pos] = states[self.src_rows, self.src_cols]
        return slab[: self.rows, : self.kv_len]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self._write(self.keys, layer_idx, key_states), self._write(self.values, layer_idx, value_states)

    def update_indexer(self, key_states, layer_idx, *args, **kwargs):
        """The DSA indexer's keys ``[B, S, dim]`` -> ``[rows, kv_len, dim]`` (transformers 5.25 Cache API)."""
        return self._write(self.index_keys, layer_idx, key_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    def move_row(self, src: int, dst: int, length: int) -> None:
        for store in self._stores():
            for slab in store:
                if slab is None:
                    continue
                if slab.dim() == 4:
                    slab[dst, :, :length] = slab[src, :, :length]
                else:
                    slab[dst, :length] = slab[src, :length]


@dataclass
class StepOutput:
    last_logits: torch.Tensor          # fp32 [rows, vocab]: logits at each row's last fed token
    routes: list[torch.Tensor] | None  # per row: int32 [fed tokens, num_hidden_layers, topk]
    indexer_topk: list[torch.Tensor] | None = None   # per row: int32 [fed tokens, num_hidden_layers, index_topk]


@dataclass
class Scored:
    """A teacher-forced pass over one sequence (CPU tensors)."""
    logits: torch.Tensor                     # fp32 [T, vocab]
    routes: torch.Tensor | None              # int32 [T, num_hidden_layers, topk], dense layers zero
    indexer_topk: torch.Tensor | None        # int32 [T, num_hidden_layers, index_topk], -1 padded


class ModelRunner:
    """Loads the model once; `forward(chunks, lengths)` runs one step over rows 0..len(chunks)-1.

    ``device`` holds the weights and the KV slab (``cuda`` for the GPU check kit); what leaves a step
    (last logits, routes, DSA selections) comes back on the CPU, where the scheduler samples.
    """

    def __init__(self, model_dir: str | Path, dtype: str = "fp32", max_batch: int = 64, max_context: int = 0,
                 device: str = "cpu"):
        import transformers

        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r} unknown; use one of {sorted(DTYPES)}")
        self.device = torch.device(device)
        self.model_dir = str(model_dir)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa").to(self.device).eval()
        use_engine_latent_norm_eps(self.model)   # MLA models: SGLang's latent-norm epsilon, not transformers'
        cfg = self.model.config
        self.config = cfg
        self.dtype = DTYPES[dtype]
        self.max_batch = max_batch
        self.max_context = max_context or int(getattr(cfg, "max_position_embeddings", 4096))
        self.num_layers = int(cfg.num_hidden_layers)
        self.routers = self._find_routers()
        self.router_layers = [self._layer_of(name) for name, _ in self.routers]
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self._captured: list[torch.Tensor | None] = [None] * len(self.routers)
        for i, (_, module) in enumerate(self.routers):
            module.register_forward_hook(self._make_hook(i))
        self.indexer = IndexerSelection(self.model, self.num_layers)
        self.cache = SlotCache(cfg.num_hidden_layers, max_batch, capacity=min(256, self.max_context),
                               device=self.device)
        self.cache_kwarg = cache_kwarg(self.model)

    @property
    def num_moe_layers(self) -> int:
        return len(self.routers)

    @property
    def index_topk(self) -> int:
        """Keys each query attends in a DSA layer; 0 when the model has no indexer."""
        return self.indexer.top_k

    def _find_routers(self) -> list[tuple[str, torch.nn.Module]]:
        """Router modules in layer order: modules whose class name ends in 'Router' and that have top_k."""
        found = [(n, m) for n, m in self.model.named_modules()
                 if type(m).__name__.endswith("Router") and hasattr(m, "top_k")]
        return found

    def _layer_of(self, name: str) -> int:
        """The global hidden-layer index of a router, from its module path (model.layers.<L>.mlp.gate)."""
        match = _LAYER.search(name)
        if match is None or not 0 <= int(match[1]) < self.num_layers:
            raise RuntimeError(f"router {name!r} is not under model.layers.<L> with L < num_hidden_layers "
                               f"{self.num_layers}: cannot place its routes on the layer axis")
        return int(match[1])

    def _make_hook(self, index: int):
        def hook(module, inputs, output):
            indices = output[-1] if isinstance(output, tuple) else output
            if indices.dtype.is_floating_point:
                raise RuntimeError(f"router {self.routers[index][0]} did not return integer top-k indices last; "
                                   "the reference server supports transformers 5 routers (logits, scores, indices)")
            self._captured[index] = indices
        return hook

    # no_grad per call, not torch.set_grad_enabled(False): grad mode is per thread, and a runner built
    # in a trainer's or a test's thread must not switch autograd off there
    @torch.no_grad()
    def forward(self, chunks: list[list[int]], lengths: list[int], want_routes: bool = True,
                want_indexer: bool = False) -> StepOutput:
        """Feed `chunks[b]` to row b whose cache holds `lengths[b]` tokens; rows must be 0..len-1."""
        rows = len(chunks)
        q = max(len(c) for c in chunks)
        ends = [lengths[b] + len(chunks[b]) for b in range(rows)]
        kv_len = max(ends)
        if kv_len > self.max_context:
            raise ValueError(f"context {kv_len} exceeds max_context {self.max_context}")
        self.cache.grow(kv_len)
        ids = torch.zeros(rows, q, dtype=torch.long)
        for b, chunk in enumerate(chunks):
            ids[b, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
        start = torch.tensor(lengths, dtype=torch.long)
        positions = start[:, None] + torch.arange(q)[None, :]
        valid = torch.arange(q)[None, :] < torch.tensor([len(c) for c in chunks])[:, None]   # [rows, q]
        ids, positions, valid = ids.to(self.device), positions.to(self.device), valid.to(self.device)
        src_rows, src_cols = valid.nonzero(as_tuple=True)
        self.cache.rows, self.cache.kv_len = rows, kv_len
        self.cache.write_rows, self.cache.write_pos = src_rows, positions[src_rows, src_cols]
        self.cache.src_rows, self.cache.src_cols = src_rows, src_cols
        key_pos = torch.arange(kv_len, device=self.device)
        mask = key_pos[None, None, :] <= positions[:, :, None]
        mask &= valid[:, :, None] | (key_pos[None, None, :] == 0)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask[:, None],
                         use_cache=True, **{self.cache_kwarg: self.cache})
        last = torch.tensor([len(c) - 1 for c in chunks], device=self.device)
        last_logits = out.logits[torch.arange(rows, device=self.device), last].float().cpu()
        routes = self._split_routes(rows, q, chunks) if want_routes and self.routers else None
        selected = None
        if want_indexer and self.indexer.enabled:
            stacked = self.indexer.layer_axis(rows * q).reshape(rows, q, self.num_layers, self.index_topk)
            selected = [stacked[b, : len(chunks[b])].clone() for b in range(rows)]
        return StepOutput(last_logits=last_logits, routes=routes, indexer_topk=selected)

    def _layer_axis(self, tokens: int) -> torch.Tensor:
        """Captured indices -> CPU int32 [tokens, num_hidden_layers, topk], dense layers' columns zero."""
        routes = torch.zeros(tokens, self.num_layers, self.top_k, dtype=torch.int32)
        for layer, captured in zip(self.router_layers, self._captured):
            routes[:, layer] = captured.reshape(tokens, -1).to(torch.int32).cpu()
        return routes

    def _split_routes(self, rows: int, q: int, chunks: list[list[int]]) -> list[torch.Tensor]:
        stacked = self._layer_axis(rows * q).reshape(rows, q, self.num_layers, self.top_k)
        return [stacked[b, : len(chunks[b])].clone() for b in range(rows)]

    @torch.no_grad()
    def teacher_forced(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Plain HF forward of one sequence, on the CPU: (fp32 logits [T, vocab], routes int32
        [T, num_hidden_layers, topk] with dense layers zero, or None without routers)."""
        scored = self.score(tokens)
        return scored.logits, scored.routes

    @torch.no_grad()
    def score(self, tokens: list[int], replay_indexer: torch.Tensor | None = None) -> Scored:
        """One teacher-forced pass without the KV slab. ``replay_indexer`` (int ``[n <= T,
        num_hidden_layers, index_topk]``, logical positions, -1 padded, as `indexer_topk` returns)
        makes the first n queries of every indexer layer attend those keys instead of selecting:
        the trainer's replay."""
        ids = torch.tensor([tokens], device=self.device)
        if replay_indexer is not None:
            self.indexer.replay = self._replay_plan(replay_indexer, len(tokens))
        try:
            out = self.model(input_ids=ids, use_cache=False)
        finally:
            self.indexer.replay = None
        routes = self._layer_axis(len(tokens)) if self.routers else None
        selected = self.indexer.layer_axis(len(tokens)) if self.indexer.enabled else None
        return Scored(logits=out.logits[0].float().cpu(), routes=routes, indexer_topk=selected)

    def _replay_plan(self, replay: torch.Tensor, num_tokens: int) -> dict[int, torch.Tensor]:
        """Replayed rows, per full indexer layer, as [1, T, index_topk]; rows past the replay select."""
        if not self.indexer.enabled:
            raise ValueError("replay_indexer given, but the model has no DSA indexer")
        want = (self.num_layers, self.index_topk)
        if replay.dim() != 3 or tuple(replay.shape[1:]) != want or replay.shape[0] > num_tokens:
            raise ValueError(f"replay_indexer has shape {tuple(replay.shape)}; expected [<= {num_tokens}, {want[0]}, "
                             f"{want[1]}]")
        plan = {}
        for layer in self.indexer.indexers:
            rows = torch.full((num_tokens, self.index_topk), NOT_GIVEN, dtype=torch.long)
            rows[: replay.shape[0]] = replay[:, layer].long()
            plan[layer] = rows[None]
        return plan
