"""DSA indexer top-k on the wire: SGLang 0.5.23's ``meta_info["indexer_topk"]``, decoded and checked.

Format (SGLang: request field ``return_indexer_topk``, server flag ``--enable-return-indexer-topk``;
managers/detokenizer_manager.py `_b64_encode_per_request`, state_capturer/indexer_topk.py
`extract_indexer_topk_from_meta_info`): base64 of the little-endian int32 bytes of a C-order tensor
``[len(prompt) + len(output) - 1, num_indexer_layers, index_topk]``. Row t is the selection of the
query at position t (the last sampled token is never fed), aligned as routed experts are. For a
DSA model ``num_indexer_layers`` is ``num_hidden_layers`` (configs/model_config.py
get_num_indexer_layers); a layer that reuses an earlier layer's selection holds a copy of it. There
is no start offset (SGLang's collector passes no start_len). Unused slots are -1.

What the values mean differs (docs/engines.md, "DSA indexer top-k"): the reference server returns
logical key positions within the request, what the trainer replays. SGLang 0.5.23 captures the
indexer output AFTER its top-k transform, which by default (SGLANG_DSA_FUSE_TOPK=1) maps positions
to KV-pool slots (decode) or ragged-batch offsets (prefill). `logical_violation` catches what cannot
be a logical position; such a reply is not replayed.

Rows whose query has at most index_topk keys (t + 1 <= index_topk) select every key whatever the
scores, and SGLang may leave them stale (its dense prefill below index_topk keys runs no indexer):
`decode_indexer_topk` rewrites them as ``[0, 1, ..., t, -1, ...]``, the same set.
"""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .routed_experts import engine_text_config, int32_values

FIELD = "meta_info.indexer_topk"


def encode_indexer_topk(topk: torch.Tensor) -> str:
    """int tensor ``[tokens, layers, index_topk]`` -> base64 of its little-endian int32 bytes."""
    if topk.dim() != 3:
        raise ValueError(f"indexer_topk must be [tokens, layers, index_topk], got shape {tuple(topk.shape)}")
    array = topk.to(torch.int32).contiguous().numpy().astype("<i4", copy=False)
    return base64.b64encode(array.tobytes()).decode("ascii")


def decode_indexer_topk(data, num_tokens: int, num_layers: int, index_topk: int) -> torch.Tensor:
    """base64 int32 -> int32 ``[num_tokens, num_layers, index_topk]``, rows below index_topk keys made
    canonical; ValueError (one line: the field, expected and received sizes) on anything else."""
    want = (num_tokens, num_layers, index_topk)
    flat = int32_values(data, FIELD)
    expected = num_tokens * num_layers * index_topk
    if flat.size != expected:
        got = f"{flat.size} int32 values"
        if num_tokens and num_layers and flat.size % (num_tokens * num_layers) == 0:
            got += f" (index_topk {flat.size // (num_tokens * num_layers)}?)"
        raise ValueError(f"{FIELD} has {got}; expected shape [tokens - 1, num_hidden_layers, index_topk] = "
                         f"{list(want)} ({expected} values)")
    topk = torch.from_numpy(flat.astype(np.int32)).reshape(want)
    return fill_every_key_rows(topk)


def fill_every_key_rows(topk: torch.Tensor) -> torch.Tensor:
    """Rows t with t + 1 <= index_topk attend every key: write them as [0..t, -1...]."""
    index_topk = topk.shape[-1]
    rows = min(index_topk, topk.shape[0])
    if rows == 0:
        return topk
    t = torch.arange(rows)[:, None]
    slots = torch.arange(index_topk)[None, :]
    every = torch.where(slots <= t, slots, torch.full_like(slots, -1)).to(topk.dtype)
    out = topk.clone()
    out[:rows] = every[:, None, :]
    return out


def logical_violation(topk: torch.Tensor) -> Optional[str]:
    """Why `topk` ([tokens, layers, index_topk]) cannot be logical key positions, or None.

    Row t may hold only -1 and positions 0..t, each at most once."""
    if topk.numel() == 0:
        return None
    t = torch.arange(topk.shape[0]).view(-1, 1, 1)
    bad = (topk < -1) | (topk > t)
    if bad.any():
        row, layer, slot = (int(i) for i in bad.nonzero()[0])
        return (f"row {row} layer {layer} holds {int(topk[row, layer, slot])}, not -1 or a key position in "
                f"[0, {row}]")
    ordered = topk.sort(dim=-1).values
    dup = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if dup.any():
        row, layer, _ = (int(i) for i in dup.nonzero()[0])
        return f"row {row} layer {layer} selects one key twice"
    return None


def indexer_shape_from_config(model_path: str | Path) -> dict:
    """{"index_topk", "num_indexer_layers"} of what an engine serving `model_path` returns, as SGLang
    reads them (num_hidden_layers for a DSA model, i.e. one with index_topk); both None without an
    indexer (DeepSeek-V3, Qwen3-MoE, ...)."""
    text = engine_text_config(model_path, "the indexer's shape")
    topk = text.get("index_topk")
    if not topk:
        return {"index_topk": None, "num_indexer_layers": None}
    return {"index_topk": int(topk), "num_indexer_layers": int(text["num_hidden_layers"])}
