"""Checks of the MLA / DSA trainer against transformers on tiny random models (tests and `sao doctor`).

transformers is the reference for everything but two engine-side facts, which the reference server and
SGLang share and the trainer follows:
- the MLA latent norms (q_a_layernorm, kv_a_layernorm) use the config's rms_norm_eps in SGLang 0.5.23
  (models/deepseek_v2.py:2077, 2163) and in Megatron; transformers 5.25 hard-codes 1e-6
  (modeling_glm_moe_dsa.py:309, 317). GLM-5's rms_norm_eps is 1e-5, so `engine_norms` sets them.
- the DSA selection: `force_selection` makes transformers' indexers return the given key positions, so
  the trainer can replay exactly what "the engine" attended to (and its own choice can be compared).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from sao_megatron.core.records import TrainBatch


def engine_norms(model) -> None:
    """Give an HF MLA model's latent norms the engine's epsilon (rms_norm_eps), in place."""
    from checkpoints.arch.glm5 import use_engine_latent_norm_eps

    use_engine_latent_norm_eps(model)


def random_selection(rows: int, seq: int, kinds: list[str], topk: int, seed: int = 0) -> torch.Tensor:
    """int32 [rows, seq, layers, topk]: for each query t up to topk distinct random keys in [0, t], -1
    padded; "shared" layers copy the previous full layer, "none" layers stay -1 (SGLang's layout)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((rows, seq, len(kinds), topk), -1, dtype=torch.int32)
    last_full = None
    for layer, kind in enumerate(kinds):
        if kind == "shared":
            out[:, :, layer] = out[:, :, last_full]
            continue
        if kind != "full":
            continue
        last_full = layer
        for r in range(rows):
            for t in range(seq):
                keys = torch.randperm(t + 1, generator=gen)[:topk]
                out[r, t, layer, :len(keys)] = keys.int()
    return out


def with_selection(batch: TrainBatch, selection: torch.Tensor) -> TrainBatch:
    return replace(batch, indexer_topk=selection)


@contextmanager
def force_selection(model, selection: torch.Tensor):
    """transformers' GLM-5 indexers return `selection` [rows, seq, layers, topk] (-1 slots become a copy of
    the row's first key, a no-op for transformers' scatter) while the context is open."""
    indexers = [(int(name.split(".")[2]), module) for name, module in model.named_modules()
                if name.endswith("self_attn.indexer")]
    saved = [(module, module.forward) for _, module in indexers]

    def make(layer):
        def forward(hidden_states, *args, **kwargs):
            chosen = selection[:, : hidden_states.shape[1], layer].long()
            return torch.where(chosen < 0, chosen[..., :1], chosen).to(torch.int32)
        return forward

    for layer, module in indexers:
        module.forward = make(layer)
    try:
        yield
    finally:
        for module, forward in saved:
            module.forward = forward


def hf_token_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """[rows, seq - 1] logprob of token t+1 under an HF causal LM."""
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
