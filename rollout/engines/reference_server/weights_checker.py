"""GET|POST /weights_checker: SGLang 0.5.23's weight checksum route, over the served model.

Body (io_struct.py CheckWeightsReqInput, every field optional): action ("checksum"),
allow_quant_error (ignored: nothing is quantized here), skip_tensor_list (name substrings to leave
out), selector ("target" | "draft" | "all"). The checksum covers the model's named parameters and
buffers in the reference server's own layout: transformers 5 names, fused experts
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), the served dtype and
device. Hashes, skips and the reply shape are rollout/weights/checksum.py's (which cites SGLang).

As SGLang answers: 200 ``{"success": true, "message": "Success.", "ranks": [...],
"per_engine_checksum": ...}``; 400 ``{"success": false, "message": ...}`` for a bad selector or an
unsupported action. With selector "draft" there is no runner (no draft model): success, no ranks.
SGLang's other actions (snapshot, reset_tensors, compare) are refused with 400 naming the action.
"""
from __future__ import annotations

import asyncio

import torch
from aiohttp import web

from rollout.weights.checksum import checksum_reply, is_skipped, tensor_checksum

from .protocol import BadRequest, parse_optional

NOT_HERE = ("snapshot", "reset_tensors", "compare")   # SGLang 0.5.23 actions the reference server lacks


def _reply(success: bool, message: str, **extra) -> web.Response:
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


def model_checksums(model: torch.nn.Module, skip_tensor_list=None) -> dict[str, str]:
    """{name: checksum} over named parameters then buffers, as SGLang's WeightChecker walks a model."""
    state = dict(model.named_parameters())
    state.update((n, b) for n, b in model.named_buffers() if n not in state)
    return {name: tensor_checksum(t.data) for name, t in state.items() if not is_skipped(name, skip_tensor_list)}


def _parse(body: dict) -> tuple[str, list | None, str]:
    action = parse_optional(body, "action", str, "checksum")
    skip = parse_optional(body, "skip_tensor_list", list)
    if skip is not None and not all(isinstance(s, str) for s in skip):
        raise BadRequest("field 'skip_tensor_list' must be a list of strings")
    parse_optional(body, "allow_quant_error", bool, False)
    return action, skip, parse_optional(body, "selector", str, "all")


async def weights_checker(state, request: web.Request, read_json) -> web.Response:
    """The route handler; `read_json` is app.py's body reader (empty body -> {})."""
    action, skip, selector = _parse(await read_json(request))
    if selector not in ("target", "draft", "all"):
        return _reply(False, f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
    if selector == "draft":
        return _reply(True, "Success.")    # no draft runner: nothing ran, nothing to report
    if action in NOT_HERE:
        return _reply(False, f"action {action!r} of SGLang's /weights_checker is not implemented by the "
                             "reference server; use action 'checksum'")
    if action != "checksum":
        return _reply(False, f"Unsupported action={action!r}")
    models = [state.runner.model]            # one TP rank: the server holds the whole model
    future = state.scheduler.call(lambda: [model_checksums(m, skip) for m in models])   # between steps
    return web.json_response(checksum_reply(await asyncio.wrap_future(future)))
