"""Reading request bodies and writing SGLang-shaped replies, shared by the route modules."""
from __future__ import annotations

import asyncio
import json
import re
import sys

from aiohttp import web

from .protocol import BadRequest, parse_optional

# ours: SGLang's bodies nest 3 deep (sampling_params.stop_token_ids); far deeper is a bug or an attack
MAX_DEPTH = 32
_SURROGATE = re.compile("[\ud800-\udfff]")


def error(status: int, message: str) -> web.Response:
    """SGLang's error body for a bad request: {"error": {"message": ...}}."""
    return web.json_response({"error": {"message": message}}, status=status)


def result(success: bool, message: str, **extra) -> web.Response:
    """SGLang's control-route reply: {"success", "message", ...}, 200 on success, else 400."""
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


async def read_json(request: web.Request) -> dict:
    """The JSON object body ({} when empty); BadRequest naming the field for anything else."""
    if not request.can_read_body:
        return {}
    raw = await request.read()
    try:
        body = _parse(raw.decode("utf-8"))
    except RecursionError:   # json's C parser recurses per level: ~1000 levels exhaust the stack
        raise BadRequest(f"request body nests JSON arrays/objects too deeply; use at most {MAX_DEPTH} levels") \
            from None
    except ValueError as err:   # JSONDecodeError, UnicodeDecodeError
        raise BadRequest(f"request body is not valid JSON: {err}") from None
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    check_values(body)
    return body


def _parse(text: str):
    try:
        return json.loads(text)
    except ValueError as err:   # an int past the 4300-digit str limit is a plain ValueError
        if isinstance(err, json.JSONDecodeError) or "digits" not in str(err):
            raise
    return json.loads(text, parse_int=_int_or_huge)   # again, keeping such ints to name their field


class _HugeInt:
    """An integer literal longer than Python's int/str conversion limit (sys.get_int_max_str_digits)."""

    def __init__(self, digits: int):
        self.digits = digits


def _int_or_huge(text: str):
    digits = len(text.lstrip("-"))
    return _HugeInt(digits) if digits > sys.get_int_max_str_digits() else int(text)


def check_values(body: dict) -> None:
    """BadRequest naming the field for what no route can use and would break it later: nesting past
    MAX_DEPTH, an integer past the digit limit, a lone UTF-16 surrogate (a JSON ``\\ud800`` escape:
    valid JSON, but no UTF-8 text, so the tokenizer and every encoder refuse it)."""
    stack = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BadRequest(f"field {path!r} nests deeper than {MAX_DEPTH} levels; no field takes that")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            where = f"{path}[{key}]" if isinstance(value, list) else (f"{path}.{key}" if path else key)
            where = where if len(where) <= 80 else where[:77] + "..."   # a key may be megabytes long
            if isinstance(key, str) and _SURROGATE.search(key):
                raise BadRequest(f"field {where!r}: its name holds a lone UTF-16 surrogate; send valid Unicode")
            if isinstance(item, str) and _SURROGATE.search(item):
                raise BadRequest(f"field {where!r} holds a lone UTF-16 surrogate; send valid Unicode text")
            if isinstance(item, _HugeInt):
                raise BadRequest(f"field {where!r} is an integer of {item.digits} digits; no field takes one "
                                 f"past {sys.get_int_max_str_digits()} digits")
            if isinstance(item, (dict, list)) and item and not _flat_numbers(item):
                stack.append((item, where, depth + 1))
            elif isinstance(item, (dict, list)) and depth + 1 > MAX_DEPTH:
                raise BadRequest(f"field {where!r} nests deeper than {MAX_DEPTH} levels; no field takes that")


def _flat_numbers(value) -> bool:
    """A list of plain numbers (input_ids, a shape): nothing in it to check, skipped in one pass."""
    return isinstance(value, list) and all(type(x) in (int, float, bool) for x in value)


def required(body: dict, name: str, kind):
    if name not in body:
        raise BadRequest(f"field {name!r} is required")
    return parse_optional(body, name, kind)


async def on_scheduler(state, fn):
    """Run `fn` on the scheduler thread between steps and return its result."""
    return await asyncio.wrap_future(state.scheduler.call(fn))
