"""DeepSeek Sparse Attention (DSA) top-k selection: the one rule the reference server and the trainer share.

DSA's indexer scores every (query, key) pair and each query attends only to its `index_topk` best keys.
The selection is discontinuous, like MoE routing: relu leaves exact ties and float noise of 1e-7 flips
near-ties, so two passes that order ties differently attend to different keys. Whoever selects (the
reference server at prefill, decode and teacher-forced passes; the trainer when it is not replaying an
engine's choices) calls `select_topk`, so every pass picks the same keys from the same scores.

Convention (also the `indexer_topk` the reference server returns and samples carry):
- input: index scores `[..., T]` over key positions 0..T-1 of the request, with `-inf` at every key the
  query may not attend (future keys, padding). NaN counts as masked.
- order: descending score; equal scores go to the lower key position first (a stable descending sort).
  `-0.0` and `0.0` are one score.
- output: `[..., topk]` int64 logical key positions within the request (not cache slots, not offsets into
  a ragged batch), in that order; a row with fewer than `topk` valid keys is filled to the right with -1.
"""
from __future__ import annotations

import torch

PAD = -1  # the position that fills a row with fewer valid keys than index_topk


def select_topk(index_scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Each query's `topk` best key positions: descending score, ties to the lower position, -1 padding.

    index_scores: float `[..., T]`, `-inf` (or NaN) at masked keys. Returns int64 `[..., topk]`.
    """
    if topk < 1:
        raise ValueError(f"select_topk: topk must be >= 1, got {topk}")
    scores = index_scores.float() + 0.0  # + 0.0 turns -0.0 into 0.0, so the two tie
    scores = scores.masked_fill(torch.isnan(scores), float("-inf"))
    keys = scores.shape[-1]
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    take = min(topk, keys)
    positions = order.indices[..., :take]
    positions = positions.masked_fill(torch.isneginf(order.values[..., :take]), PAD)
    if take < topk:
        pad = positions.new_full((*positions.shape[:-1], topk - take), PAD)
        positions = torch.cat([positions, pad], dim=-1)
    return positions


def causal_index_mask(query_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Bool `[..., Q, num_keys]`: True where key position <= the query's position (the keys it may select).

    query_positions: int `[..., Q]`, each query's logical position in the request.
    """
    keys = torch.arange(num_keys, device=query_positions.device)
    return keys <= query_positions.unsqueeze(-1)


def selected_key_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Bool `[..., num_keys]`: True at the keys `positions` (from `select_topk`, -1 ignored) selects."""
    mask = torch.zeros((*positions.shape[:-1], num_keys + 1), dtype=torch.bool, device=positions.device)
    # -1 lands in the extra last column, which is dropped
    mask.scatter_(-1, torch.where(positions < 0, num_keys, positions).long(), True)
    return mask[..., :num_keys]
