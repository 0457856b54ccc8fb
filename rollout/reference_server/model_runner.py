"""The HF transformers model behind the reference server: one batched forward per scheduler step.

Every active request owns one row ("slot") of a per-layer KV slab ``[max_batch, kv_heads, T, head_dim]``;
rows 0..n-1 are the active requests (a finished request's row is refilled by the last one, so the
active rows stay contiguous and the forward uses a view, not a copy). A step feeds each row the tokens
it has not cached yet (a whole prompt, or the one token sampled last step), right-padded to the
longest chunk. Row b's token j sits at position ``len_b + j`` and attends to keys ``<= len_b + j``;
padded queries attend to key 0 only so no softmax row is empty (their outputs are discarded and
their keys are never written).

Routing capture: a forward hook on every router module (transformers 5: Qwen3-MoE's
``Qwen3MoeTopKRouter`` and GLM-4.5's ``Glm4MoeTopkRouter`` both return ``(logits, weights, indices)``)
records the top-k expert indices of every fed token. Routes have SGLang's layer axis: one column per
hidden layer, indexed by the router's global layer id (its ``layers.<L>.`` module path), and dense
layers (GLM's first ``first_k_dense_replace``, Qwen3's ``mlp_only_layers``) left zero. SGLang sizes
its capture buffer by ``num_hidden_layers`` (state_capturer/routed_experts.py:72-73), writes column
``layer_id`` (state_capturer/base.py:47-49) where TopK's layer_id is the owning layer's global index
(layers/moe/topk.py:680), and starts from zeros (base.py:38-41, 68-75).
"""
from __future__ import annotations

import inspect
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

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
    """Duck-typed transformers Cache over the KV slab; `plan` is set before each forward."""

    is_compileable = False

    def __init__(self, num_layers: int, max_batch: int, kv_heads: int, head_dim: int, dtype, capacity: int,
                 device: torch.device | str = "cpu"):
        shape = (max_batch, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.rows = self.kv_len = 0
        self.write_rows = self.write_pos = self.src_rows = self.src_cols = None

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def grow(self, needed: int) -> None:
        """Double the time axis until it holds `needed` positions (the slab starts small)."""
        new_cap = self.capacity
        while new_cap < needed:
            new_cap *= 2
        if new_cap == self.capacity:
            return
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                pad = old.new_zeros(old.shape[0], old.shape[1], new_cap - old.shape[2], old.shape[3])
                store[i] = torch.cat([old, pad], dim=2)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[self.write_rows, :, self.write_pos] = key_states[self.src_rows, :, self.src_cols]
        v[self.write_rows, :, self.write_pos] = value_states[self.src_rows, :, self.src_cols]
        return k[: self.rows, :, : self.kv_len], v[: self.rows, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    def move_row(self, src: int, dst: int, length: int) -> None:
        for store in (self.keys, self.values):
            for layer in store:
                layer[dst, :, :length] = layer[src, :, :length]


@dataclass
class StepOutput:
    last_logits: torch.Tensor          # fp32 [rows, vocab]: logits at each row's last fed token
    routes: list[torch.Tensor] | None  # per row: int32 [fed tokens, num_hidden_layers, topk]


class ModelRunner:
    """Loads the model once; `forward(chunks, lengths)` runs one step over rows 0..len(chunks)-1.

    ``device`` holds the weights and the KV slab (``cuda`` for the GPU check kit); what leaves a step
    (last logits, routes) comes back on the CPU, where the scheduler samples.
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
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.cache = SlotCache(cfg.num_hidden_layers, max_batch, cfg.num_key_value_heads, head_dim,
                               self.dtype, capacity=min(256, self.max_context), device=self.device)
        self.cache_kwarg = cache_kwarg(self.model)

    @property
    def num_moe_layers(self) -> int:
        return len(self.routers)

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
    def forward(self, chunks: list[list[int]], lengths: list[int], want_routes: bool = True) -> StepOutput:
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
        return StepOutput(last_logits=last_logits, routes=routes)

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
        out = self.model(input_ids=torch.tensor([tokens], device=self.device), use_cache=False)
        routes = self._layer_axis(len(tokens)) if self.routers else None
        return out.logits[0].float().cpu(), routes
