"""Reading request bodies and writing SGLang-shaped replies, shared by the route modules."""
from __future__ import annotations

import asyncio
import json

from aiohttp import web

from .protocol import BadRequest, parse_optional


def error(status: int, message: str) -> web.Response:
    """SGLang's error body for a bad request: {"error": {"message": ...}}."""
    return web.json_response({"error": {"message": message}}, status=status)


def result(success: bool, message: str, **extra) -> web.Response:
    """SGLang's control-route reply: {"success", "message", ...}, 200 on success, else 400."""
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


async def read_json(request: web.Request) -> dict:
    """The JSON object body ({} when empty); BadRequest for anything else."""
    if not request.can_read_body:
        return {}
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"request body is not valid JSON: {err}") from None
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def required(body: dict, name: str, kind):
    if name not in body:
        raise BadRequest(f"field {name!r} is required")
    return parse_optional(body, name, kind)


async def on_scheduler(state, fn):
    """Run `fn` on the scheduler thread between steps and return its result."""
    return await asyncio.wrap_future(state.scheduler.call(fn))
