"""DeepSeek Sparse Attention (DSA) in the reference server: HF's indexer with our selection rule.

transformers' indexers (GlmMoeDsaIndexer, DeepseekV32Indexer in 5.25) score keys and then take
``index_scores.topk``, whose order among tied scores depends on the shapes of the call: prefill,
decode and teacher-forced passes of one sequence then attend to different keys (relu leaves exact
ties). Here each indexer module's forward is replaced by one that reuses the module's projections
and RoPE to compute the same scores (``sum_h w_h * relu(q_h . k) * scale``, masked to the keys the
query may attend, i.e. key position <= query position) and selects with
`checkpoints.arch.dsa.select_topk`, the rule the trainer shares: descending score, ties to the
lower key position, -1 where a row has fewer valid keys than index_topk.

Because the reference server's KV slot ``t`` of a row holds the request's token ``t``, the selected
key indices ARE logical token positions within the request: what `indexer_topk` returns.

Layers whose ``indexer_types`` entry is ``"shared"`` (GLM-5's index_topk_freq) have no indexer: HF
passes them the previous full layer's selection, and the capture mirrors it into their column, as
SGLang does (models/deepseek_common/attention_forward_methods/forward_mla.py:389-394, capture slot
per hidden layer: configs/model_config.py get_num_indexer_layers).
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from checkpoints.arch.dsa import select_topk

# indexer class -> the RoPE function of its modeling module that its forward applies
# (GLM-5: interleaved pairs; DeepSeek-V3.2: half split)
NOT_GIVEN = -2   # a replay row starting with this selects for itself
ROPE_OF_INDEXER = {"GlmMoeDsaIndexer": "apply_rotary_pos_emb_interleave", "DeepseekV32Indexer": "apply_rotary_pos_emb"}


def find_indexers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """layer_idx -> indexer module. A module named like an indexer whose class we do not know is
    refused: serving it with HF's own top-k would make prefill and decode disagree."""
    found = {}
    for name, module in model.named_modules():
        kind = type(module).__name__
        if not (kind.endswith("Indexer") and hasattr(module, "index_topk")):
            continue
        if kind not in ROPE_OF_INDEXER:
            raise RuntimeError(f"{name} is a {kind}; the reference server selects DSA keys only for "
                               f"{', '.join(sorted(ROPE_OF_INDEXER))}")
        found[int(module.layer_idx)] = module
    return found


def source_layers(indexers: dict[int, torch.nn.Module], num_layers: int) -> list[int]:
    """For each hidden layer, the layer whose indexer selection it uses: itself when it has an
    indexer, else the nearest earlier layer that has one (HF passes top-k down the stack)."""
    sources, last = [], None
    for layer in range(num_layers):
        if layer in indexers:
            last = layer
        if last is None:
            raise RuntimeError(f"DSA layer {layer} reuses an earlier layer's top-k but no earlier layer has an "
                               "indexer (config.indexer_types must start with 'full')")
        sources.append(last)
    return sources


def index_scores(module, rope: Callable, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                 position_embeddings, attention_mask: torch.Tensor, cache=None) -> torch.Tensor:
    """fp32 ``[B, S, T]`` index scores, -inf where the mask forbids the key. The math of
    transformers 5.25 GlmMoeDsaIndexer.forward / DeepseekV32Indexer.forward up to their top-k."""
    batch, seq, _ = hidden_states.shape
    cos, sin = position_embeddings
    rope_dim = module.qk_rope_head_dim
    q = module.wq_b(q_resid).view(batch, seq, module.n_heads, module.head_dim)
    q_rot, q_pass = torch.split(q, [rope_dim, module.head_dim - rope_dim], dim=-1)
    k = module.k_norm(module.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope_dim, module.head_dim - rope_dim], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    if cache is not None:
        k = cache.update_indexer(k, module.layer_idx)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * module.softmax_scale)
    weights = module.weights_proj(hidden_states.to(module.weights_proj.weight.dtype)).float() * module.n_heads ** -0.5
    scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:   # additive float mask: finfo.min (or -inf) where masked
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    return scores.masked_fill(~allowed, float("-inf"))


class IndexerSelection:
    """Installs our selection in every indexer of `model` and records what each forward selects.

    ``captured[layer]``: int64 ``[B, S, index_topk]`` logical key positions (-1 padded) of the last
    forward, for every hidden layer (shared layers mirror their source). ``replay``: when set to
    ``{layer: [B, S, index_topk]}``, full layers use these positions instead of selecting (a
    teacher-forced pass that replays an engine's choices, as the trainer does); a row whose first
    entry is NOT_GIVEN selects for itself.
    """

    def __init__(self, model: torch.nn.Module, num_layers: int):
        self.indexers = find_indexers(model)
        self.num_layers = num_layers
        self.top_k = 0
        self.sources: list[int] = []
        self.captured: dict[int, torch.Tensor] = {}
        self.replay: Optional[dict[int, torch.Tensor]] = None
        if not self.indexers:
            return
        self.top_k = int(next(iter(self.indexers.values())).index_topk)
        self.sources = source_layers(self.indexers, num_layers)
        for module in self.indexers.values():
            rope = getattr(sys.modules[type(module).__module__], ROPE_OF_INDEXER[type(module).__name__])
            module.forward = self._forward_for(module, rope)

    @property
    def enabled(self) -> bool:
        return bool(self.indexers)

    def _forward_for(self, module, rope):
        def forward(hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None,
                    **kwargs):
            cache = cache if cache is not None else kwargs.get("past_key_values")
            scores = index_scores(module, rope, hidden_states, q_resid, position_embeddings, attention_mask, cache)
            positions = select_topk(scores, self.top_k)
            if self.replay is not None and module.layer_idx in self.replay:
                given = self.replay[module.layer_idx].to(scores.device, torch.long)
                positions = torch.where(given[..., :1] == NOT_GIVEN, positions, given)
            self.captured[module.layer_idx] = positions
            # HF scatters these into its sparse mask: no -1 there; repeating a selected key changes nothing
            # (every row has one: a padded query may attend key 0)
            return torch.where(positions >= 0, positions, positions[..., :1].clamp(min=0)).to(torch.int32)
        return forward

    def layer_axis(self, tokens: int) -> torch.Tensor:
        """The last forward's selections -> CPU int32 ``[tokens, num_hidden_layers, index_topk]``."""
        out = torch.empty(tokens, self.num_layers, self.top_k, dtype=torch.int32)
        for layer, source in enumerate(self.sources):
            out[:, layer] = self.captured[source].reshape(tokens, self.top_k).to(torch.int32).cpu()
        return out
