"""Raw HTTP calls to a reference server for its tests: the SGLang routes the client does not wrap,
and GET /sao_server_info (ours, not SGLang's) for the scheduler's live state."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

import aiohttp


async def call(url: str, key: str, method: str, path: str, body: Optional[dict] = None) -> tuple[int, Any]:
    """(status, JSON reply or text) of one request."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.request(method, url + path, json=body) as reply:
            text = await reply.text()
            try:
                return reply.status, json.loads(text)
            except json.JSONDecodeError:
                return reply.status, text


async def post(url: str, key: str, path: str, body: Optional[dict] = None) -> tuple[int, Any]:
    return await call(url, key, "POST", path, body if body is not None else {})


async def scheduler_state(url: str, key: str) -> dict:
    status, info = await call(url, key, "GET", "/sao_server_info")
    assert status == 200, info
    return info["scheduler"]


async def wait_for(url: str, key: str, predicate, task: Optional[asyncio.Task] = None) -> dict:
    """Poll the scheduler state until `predicate`; fail (not hang) if `task` finished first."""
    while True:
        state = await scheduler_state(url, key)
        if predicate(state):
            return state
        if task is not None and task.done():
            raise AssertionError(f"request finished before the state was reached: {task.result()}")
        await asyncio.sleep(0.02)
