"""SGLang's /generate JSON, parsed strictly, and the reply built the way SGLang shapes it.

Request fields are SGLang's (srt/managers/io_struct.py GenerateReqInput); anything the reference
server does not implement is refused with a 400 naming the field, never silently ignored. The reply
is SGLang's ``{text, output_ids, meta_info}``; one meta_info field is our extension (ignored by
SGLang clients): ``output_token_weight_versions`` (one int per output token). SGLang's own per-token
record, ``weight_versions`` spans ``[{version, start, end}]`` over output-token indices, is produced
as well.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from rollout.routed_experts import encode_routed_experts

from .sampling import SamplingParams

GENERATE_FIELDS = {"rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "return_text_in_logprobs", "return_routed_experts",
                   "routed_experts_start_len", "stream", "log_metrics",
                   "extra_key"}   # SGLang's prefix-cache namespace; accepted, unused: no prefix cache here
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                   "ignore_eos", "skip_special_tokens", "no_stop_trim", "sampling_seed", "n",
                   "spaces_between_special_tokens"}


class BadRequest(ValueError):
    """A client error: the HTTP layer answers 400 with this message."""


@dataclass
class ParsedGenerate:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    return_routes: bool
    routes_start: int


def _typed(value: Any, kind, name: str, allow_none: bool = False):
    if value is None and allow_none:
        return None
    ok = isinstance(value, kind) and not (kind in (int, (int, float)) and isinstance(value, bool))
    if not ok:
        want = kind.__name__ if isinstance(kind, type) else "number"
        raise BadRequest(f"field {name!r} must be {want}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"field {name!r} must be finite, got {value}")
    return value


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if isinstance(value, list) and value and isinstance(value[0], list):
            raise BadRequest(f"field {name!r}: batched requests are not supported; send one prompt per request")
        raise BadRequest(f"field {name!r} must be a list of ints")
    return value


def parse_sampling(raw: Any, eos_ids: list[int]) -> SamplingParams:
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise BadRequest("field 'sampling_params' must be an object")
    unknown = sorted(set(raw) - SAMPLING_FIELDS)
    if unknown:
        raise BadRequest(f"sampling_params.{unknown[0]} is not supported by the reference server")
    p = SamplingParams()
    p.max_new_tokens = _typed(raw.get("max_new_tokens", 128), int, "sampling_params.max_new_tokens")
    p.temperature = float(_typed(raw.get("temperature", 1.0), (int, float), "sampling_params.temperature"))
    p.top_p = float(_typed(raw.get("top_p", 1.0), (int, float), "sampling_params.top_p"))
    p.top_k = _typed(raw.get("top_k", -1), int, "sampling_params.top_k")
    p.min_p = float(_typed(raw.get("min_p", 0.0), (int, float), "sampling_params.min_p"))
    p.stop_token_ids = _int_list(raw.get("stop_token_ids") or [], "sampling_params.stop_token_ids")
    p.ignore_eos = _typed(raw.get("ignore_eos", False), bool, "sampling_params.ignore_eos")
    p.skip_special_tokens = _typed(raw.get("skip_special_tokens", True), bool, "sampling_params.skip_special_tokens")
    p.sampling_seed = _typed(raw.get("sampling_seed"), int, "sampling_params.sampling_seed", allow_none=True)
    if p.max_new_tokens < 1:
        raise BadRequest(f"sampling_params.max_new_tokens must be >= 1, got {p.max_new_tokens}")
    if p.temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
    if p.top_k == 0 or p.top_k < -1:
        raise BadRequest(f"sampling_params.top_k must be -1 (off) or >= 1, got {p.top_k}")
    if not 0 <= p.min_p < 1:
        raise BadRequest(f"sampling_params.min_p must be in [0, 1), got {p.min_p}")
    if raw.get("stop"):
        raise BadRequest("sampling_params.stop (stop strings) is not supported; use stop_token_ids")
    if raw.get("n", 1) != 1:
        raise BadRequest("sampling_params.n must be 1; send one request per sample")
    return p


def parse_generate(body: Any, vocab_size: int, max_context: int, tokenizer, eos_ids: list[int],
                   has_routers: bool) -> ParsedGenerate:
    """Validate a /generate body; BadRequest names the first offending field."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise BadRequest(f"field {unknown[0]!r} is not supported by the reference server")
    if body.get("stream"):
        raise BadRequest("field 'stream': streaming is not supported by the reference server; set it false")
    if body.get("top_logprobs_num"):
        raise BadRequest("field 'top_logprobs_num': top logprobs are not supported; use 0")
    rid = _typed(body.get("rid"), str, "rid", allow_none=True) or uuid.uuid4().hex
    input_ids = _input_ids(body, tokenizer)
    if not input_ids:
        raise BadRequest("field 'input_ids' is empty")
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"field 'input_ids' holds token {bad[0]} outside the vocabulary [0, {vocab_size})")
    if len(input_ids) >= max_context:
        raise BadRequest(f"input is too long: {len(input_ids)} tokens >= max_context {max_context}")
    start = body.get("logprob_start_len")
    if start is not None and _typed(start, int, "logprob_start_len") not in (-1, len(input_ids)):
        raise BadRequest("field 'logprob_start_len': prompt-token logprobs are not supported; use -1")
    want_routes = bool(_typed(body.get("return_routed_experts", False), bool, "return_routed_experts"))
    if want_routes and not has_routers:
        raise BadRequest("field 'return_routed_experts': the served model has no MoE routers")
    routes_start = _typed(body.get("routed_experts_start_len", 0), int, "routed_experts_start_len")
    if not 0 <= routes_start <= len(input_ids):
        raise BadRequest(f"field 'routed_experts_start_len' must be in [0, {len(input_ids)}], got {routes_start}")
    return ParsedGenerate(rid=rid, input_ids=input_ids, params=parse_sampling(body.get("sampling_params"), eos_ids),
                          return_logprob=bool(_typed(body.get("return_logprob", False), bool, "return_logprob")),
                          return_routes=want_routes, routes_start=routes_start)


def _input_ids(body: dict, tokenizer) -> list[int]:
    if body.get("input_ids") is not None:
        return _int_list(body["input_ids"], "input_ids")
    text = body.get("text")
    if text is None:
        raise BadRequest("one of 'input_ids' or 'text' is required")
    if not isinstance(text, str):
        raise BadRequest("field 'text' must be a string (batched requests are not supported)")
    if tokenizer is None:
        raise BadRequest("field 'text': the model directory has no tokenizer; send input_ids")
    return list(tokenizer.encode(text, add_special_tokens=False))


def version_spans(versions: list[int]) -> list[dict]:
    """Per-token versions -> SGLang's spans [{version, start, end}] over output-token indices."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def build_response(req, tokenizer, current_version: int) -> dict:
    """The /generate reply for a finished scheduler Request."""
    text = tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens) if tokenizer else ""
    versions = list(req.versions)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "num_retractions": req.retractions,
        "weight_version": str(versions[-1] if versions else current_version),
        "weight_versions": version_spans(versions),
        "output_token_weight_versions": versions,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(req.logprobs, req.output_ids)]
    if req.return_routes and req.routes is not None:   # None: aborted before its first step
        fed = max(len(req.input_ids) + len(req.output_ids) - 1, 0)
        meta["routed_experts"] = encode_routed_experts(req.routes[req.routes_start: fed])
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


def parse_optional(body: Any, name: str, kind, default: Optional[Any] = None):
    """One optional typed field of a control request body."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    value = body.get(name, default)
    return _typed(value, kind, name, allow_none=default is None)
