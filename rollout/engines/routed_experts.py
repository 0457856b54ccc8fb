"""Routed experts on the wire: SGLang's base64 of little-endian int32, shape [tokens, layers, topk].

SGLang (``--enable-return-routed-experts``, ``return_routed_experts: true``) returns in
``meta_info.routed_experts`` the bytes of an int32 tensor of shape
``(len(prompt) + len(output) - 1, num_layers, top_k)``: the experts each fed token position was
routed to (the last sampled token is never fed, hence the -1). ``num_layers`` is the model's
``num_hidden_layers``, every layer, dense ones included: column l is global layer l (0-based), and a
dense layer's column stays zero (SGLang 0.5.23 state_capturer/routed_experts.py sizes the buffer by
num_hidden_layers; each MoE TopK writes at its own layer_id). The shape itself is not sent, so the
decoder needs ``top_k`` (and checks it against the token count it expects).
"""
from __future__ import annotations

import base64

import numpy as np
import torch


def encode_routed_experts(routes: torch.Tensor) -> str:
    """int tensor [tokens, layers, topk] -> base64 of its little-endian int32 bytes (C order)."""
    if routes.dim() != 3:
        raise ValueError(f"routed_experts must be [tokens, layers, topk], got shape {tuple(routes.shape)}")
    array = routes.to(torch.int32).contiguous().numpy().astype("<i4", copy=False)
    return base64.b64encode(array.tobytes()).decode("ascii")


def decode_routed_experts(data: str, num_tokens: int, top_k: int, num_layers: int | None = None) -> torch.Tensor:
    """base64 int32 -> tensor int32 [num_tokens, layers, top_k]; ValueError naming the mismatch.

    ``layers`` is inferred as ``n_ints / (num_tokens * top_k)``; pass ``num_layers`` (the model's
    num_hidden_layers, not its MoE-layer count) to check it too.
    """
    flat = int32_values(data, "routed_experts")
    per_token = num_tokens * top_k
    if num_tokens == 0:
        if flat.size:
            raise ValueError(f"routed_experts has {flat.size} values for 0 token positions")
        return torch.zeros(0, num_layers or 0, top_k, dtype=torch.int32)
    if per_token <= 0 or flat.size % per_token:
        raise ValueError(f"routed_experts has {flat.size} values, not divisible by tokens*topk = "
                         f"{num_tokens}*{top_k}")
    layers = flat.size // per_token
    if num_layers is not None and layers != num_layers:
        raise ValueError(f"routed_experts has {layers} layers per token, expected {num_layers}")
    routes = torch.from_numpy(flat.astype(np.int32)).reshape(num_tokens, layers, top_k)
    if routes.numel() and int(routes.min()) < 0:
        raise ValueError("routed_experts holds a negative expert id")
    return routes


def int32_values(data, field: str) -> np.ndarray:
    """SGLang's base64 little-endian int32 payload (routed experts, indexer top-k) as a flat array;
    ValueError naming `field` for anything else."""
    if not isinstance(data, str):
        raise ValueError(f"{field} must be a base64 string, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{field} is not valid base64: {err}") from None
    if len(raw) % 4:
        raise ValueError(f"{field} has {len(raw)} bytes, not a whole number of int32 values")
    return np.frombuffer(raw, dtype="<i4")


def engine_text_config(model_path, what: str) -> dict:
    """The text config of an engine's config.json (`text_config` when nested), as SGLang reads it; a
    ValueError naming `what` and the file when it cannot be read."""
    import json
    from pathlib import Path

    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {what} from {path}: {err}; fix: point model.path at an HF model "
                         "directory") from None
    return config.get("text_config") or config


def route_shape_from_config(model_path) -> dict:
    """{"moe_topk", "num_layers"} of the routes an engine serving `model_path` returns, from its
    config.json as SGLang reads them (state_capturer/routed_experts.py: num_experts_per_tok and
    num_hidden_layers of the text config); both None for a dense model."""
    text = engine_text_config(model_path, "the routes' shape")
    topk = text.get("num_experts_per_tok")
    return {"moe_topk": topk, "num_layers": text.get("num_hidden_layers") if topk else None}
