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

from rollout.engines.indexer_topk import encode_indexer_topk
from rollout.engines.routed_experts import encode_routed_experts

from .sampling import SamplingParams

GENERATE_FIELDS = {"rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "return_text_in_logprobs", "return_routed_experts",
                   "routed_experts_start_len", "return_indexer_topk", "stream", "log_metrics",
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
    return_indexer_topk: bool = False


INT32_MAX = 2**31 - 1            # SGLang holds top_k in an int32 tensor (sampling_batch_info.py:147)
SEED_RANGE = (-(2**63), 2**63 - 1)   # SGLang sampling_params.py:308
MAX_RID_CHARS = 1024             # ours: a rid is an id, not a payload
# SGLang 0.5.23's context refusals (tokenizer_manager.py _validate_one_request), answered 400 as
# {"error": {"message": ...}} (http_server.py _create_error_response); pinned by test_sglang_behaviour_contract.py
INPUT_TOO_LONG = "The input ({input} tokens) is longer than the model's context length ({context} tokens)."
TOTAL_TOO_LONG = ("Requested token count exceeds the model's maximum context length of {context} tokens. "
                  "You requested a total of {total} tokens: {input} tokens from the input messages and "
                  "{new} tokens for the completion. Please reduce the number of tokens in the input messages "
                  "or the completion to fit within the limit.")


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


def _number(raw: dict, key: str, default: float, prefix: str = "sampling_params.") -> float:
    """A finite float; JSON null means the default (as SGLang's SamplingParams.__post_init__)."""
    name = prefix + key
    value = _typed(raw.get(key), (int, float), name, allow_none=True)
    if value is None:
        return default
    try:
        return float(value)
    except OverflowError:   # an int too large for a float
        raise BadRequest(f"field {name!r} must be a finite number, "
                         f"got an integer of {value.bit_length()} bits") from None


def _int(raw: dict, key: str, default: Optional[int], lo: int, hi: Optional[int], name: str) -> Optional[int]:
    """An int in [lo, hi] (hi None = unbounded); JSON null means the default."""
    value = _typed(raw.get(key), int, name, allow_none=True)
    if value is None:
        return default
    if value < lo or (hi is not None and value > hi):
        want = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise BadRequest(f"field {name!r} must be {want}, got {_short(value)}")
    return value


def _flag(raw: dict, key: str, default: bool, prefix: str = "") -> bool:
    value = _typed(raw.get(key), bool, prefix + key, allow_none=True)
    return default if value is None else value


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...({value.bit_length()} bits)"


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if isinstance(value, list) and value and isinstance(value[0], list):
            raise BadRequest(f"field {name!r}: batched requests are not supported; send one prompt per request")
        raise BadRequest(f"field {name!r} must be a list of ints")
    return value


def parse_sampling(raw: Any, eos_ids: list[int]) -> SamplingParams:
    """SGLang's SamplingParams.verify ranges (sampling_params.py:252); stricter where docs/engines.md says."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise BadRequest("field 'sampling_params' must be an object")
    unknown = sorted(set(raw) - SAMPLING_FIELDS)
    if unknown:
        raise BadRequest(f"sampling_params.{unknown[0]} is not supported by the reference server")
    p = SamplingParams()
    p.max_new_tokens = _typed(raw.get("max_new_tokens", 128), int, "sampling_params.max_new_tokens")
    if p.max_new_tokens < 1:
        raise BadRequest(f"sampling_params.max_new_tokens must be >= 1, got {_short(p.max_new_tokens)}")
    p.temperature = _number(raw, "temperature", 1.0)
    if p.temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be >= 0, got {p.temperature}")
    p.top_p = _number(raw, "top_p", 1.0)
    if not 0 < p.top_p <= 1:
        raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
    p.top_k = _int(raw, "top_k", -1, -1, INT32_MAX, "sampling_params.top_k")
    if p.top_k == 0:
        raise BadRequest("sampling_params.top_k must be -1 (off) or >= 1, got 0")
    p.min_p = _number(raw, "min_p", 0.0)
    if not 0 <= p.min_p <= 1:
        raise BadRequest(f"sampling_params.min_p must be in [0, 1], got {p.min_p}")
    p.sampling_seed = _int(raw, "sampling_seed", None, *SEED_RANGE, "sampling_params.sampling_seed")
    p.stop_token_ids = _int_list(raw.get("stop_token_ids") or [], "sampling_params.stop_token_ids")
    p.ignore_eos = _flag(raw, "ignore_eos", False, "sampling_params.")
    p.skip_special_tokens = _flag(raw, "skip_special_tokens", True, "sampling_params.")
    _flag(raw, "no_stop_trim", False, "sampling_params.")             # no stop strings: nothing to trim
    _flag(raw, "spaces_between_special_tokens", True, "sampling_params.")
    _check_stop(raw.get("stop"))
    if _int(raw, "n", 1, 1, None, "sampling_params.n") != 1:
        raise BadRequest("sampling_params.n must be 1; send one request per sample")
    return p


def _check_stop(stop: Any) -> None:
    """Stop strings: str or list of str (SGLang's types); any non-empty one is refused."""
    if stop is None or stop == "" or stop == []:
        return
    if not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise BadRequest("field 'sampling_params.stop' must be a string or a list of strings, "
                         f"got {type(stop).__name__}")
    raise BadRequest("sampling_params.stop (stop strings) is not supported; use stop_token_ids")


def parse_generate(body: Any, vocab_size: int, max_context: int, tokenizer, eos_ids: list[int],
                   has_routers: bool) -> ParsedGenerate:
    """Validate a /generate body; BadRequest names the first offending field."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise BadRequest(f"field {unknown[0]!r} is not supported by the reference server")
    if _flag(body, "stream", False):
        raise BadRequest("field 'stream': streaming is not supported by the reference server; set it false")
    if _int(body, "top_logprobs_num", 0, 0, None, "top_logprobs_num"):
        raise BadRequest("field 'top_logprobs_num': top logprobs are not supported; use 0")
    _flag(body, "return_text_in_logprobs", False), _flag(body, "log_metrics", True)
    rid = _rid(body)
    _typed(body.get("extra_key"), str, "extra_key", allow_none=True)
    input_ids = _input_ids(body, tokenizer)
    if not input_ids:
        raise BadRequest("field 'input_ids' is empty")
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"field 'input_ids' holds token {_short(bad[0])} outside the vocabulary [0, {vocab_size})")
    check_context(len(input_ids), body.get("sampling_params"), max_context)
    start = _int(body, "logprob_start_len", -1, -1, None, "logprob_start_len")
    if start not in (-1, len(input_ids)):
        raise BadRequest("field 'logprob_start_len': prompt-token logprobs are not supported; use -1")
    want_routes = _flag(body, "return_routed_experts", False)
    if want_routes and not has_routers:
        raise BadRequest("field 'return_routed_experts': the served model has no MoE routers")
    routes_start = _int(body, "routed_experts_start_len", 0, 0, len(input_ids), "routed_experts_start_len")
    # SGLang takes it from any request and answers it only from a server started with
    # --enable-return-indexer-topk serving a DSA model; otherwise the reply just has no indexer_topk
    want_indexer = _flag(body, "return_indexer_topk", False)
    return ParsedGenerate(rid=rid, input_ids=input_ids, params=parse_sampling(body.get("sampling_params"), eos_ids),
                          return_logprob=_flag(body, "return_logprob", False),
                          return_routes=want_routes, routes_start=routes_start, return_indexer_topk=want_indexer)


def check_context(input_len: int, sampling: Any, max_context: int) -> None:
    """SGLang's two context checks, in its order and words (tokenizer_manager.py _validate_one_request,
    without --allow-auto-truncate, which would trim instead): the prompt must be shorter than the
    context, and prompt + an explicit max_new_tokens must fit it. An absent max_new_tokens is not
    checked (generation then stops with `length` at the context), as in SGLang."""
    if input_len >= max_context:
        raise BadRequest(INPUT_TOO_LONG.format(input=input_len, context=max_context))
    new = sampling.get("max_new_tokens") if isinstance(sampling, dict) else None
    if isinstance(new, int) and not isinstance(new, bool) and new + input_len > max_context:
        raise BadRequest(TOTAL_TOO_LONG.format(context=max_context, total=new + input_len, input=input_len,
                                               new=new))


def _rid(body: dict) -> str:
    """The client's rid (a fresh one when absent or empty); a list is SGLang's batch form, refused here."""
    if isinstance(body.get("rid"), list):
        raise BadRequest("field 'rid': batched requests are not supported; send one rid per request")
    rid = _typed(body.get("rid"), str, "rid", allow_none=True)
    if rid and len(rid) > MAX_RID_CHARS:
        raise BadRequest(f"field 'rid' is {len(rid)} characters; use at most {MAX_RID_CHARS}")
    return rid or uuid.uuid4().hex


def _input_ids(body: dict, tokenizer) -> list[int]:
    """input_ids when given (as SGLang, they win over text), else the tokenized text."""
    if not isinstance(body.get("text"), (str, type(None))):
        raise BadRequest("field 'text' must be a string (batched requests are not supported)")
    if body.get("input_ids") is not None:
        return _int_list(body["input_ids"], "input_ids")
    text = body.get("text")
    if text is None:
        raise BadRequest("one of 'input_ids' or 'text' is required")
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
    if req.return_indexer_topk and req.indexer_topk is not None:   # SGLang has no start_len for these
        fed = max(len(req.input_ids) + len(req.output_ids) - 1, 0)
        meta["indexer_topk"] = encode_indexer_topk(req.indexer_topk[:fed])
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


def parse_optional(body: Any, name: str, kind, default: Optional[Any] = None):
    """One optional typed field of a control request body."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    value = body.get(name, default)
    return _typed(value, kind, name, allow_none=default is None)
