"""A reward model served over HTTP.

Protocol (one request per sample): ``POST {url}/score`` with JSON
``{"prompt": str, "response": str, "label": any}`` and, when an API key is set, the header
``Authorization: Bearer <key>``; the server answers ``{"reward": float, ...}`` (extra keys go to
``sample.reward_info``). Non-2xx answers and malformed bodies raise, which marks the sample FAILED.

Recipe: ``rollout.reward_fn = "rollout.rewards.reward_model:RewardModel"`` with the URL in
``rollout.reward_model_url`` (when the config has that field) or the environment variable
``SAO_REWARD_MODEL_URL``; the key comes from ``SAO_REWARD_MODEL_API_KEY``.
"""
from __future__ import annotations

import os

from sao_megatron.core.records import Sample


class RewardModel:
    def __init__(self, url: str, timeout_s: float = 10.0, api_key: str = ""):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward model url {url!r} must start with http:// or https://")
        self.url = url.rstrip("/") + "/score"
        self.timeout_s = timeout_s
        self.api_key = api_key
        self._session = None

    @classmethod
    def from_config(cls, cfg) -> "RewardModel":
        url = getattr(cfg, "reward_model_url", "") or os.environ.get("SAO_REWARD_MODEL_URL", "")
        if not url:
            raise ValueError("rollout.reward_fn is the HTTP reward model but no URL is set; "
                             "set rollout.reward_model_url or SAO_REWARD_MODEL_URL")
        return cls(url, timeout_s=cfg.reward_timeout_s, api_key=os.environ.get("SAO_REWARD_MODEL_API_KEY", ""))

    async def _get_session(self):
        import aiohttp
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def __call__(self, sample: Sample) -> dict:
        session = await self._get_session()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"prompt": sample.prompt_text, "response": sample.response_text, "label": sample.label}
        async with session.post(self.url, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                raise RuntimeError(f"reward model {self.url} answered HTTP {resp.status}: {text}")
            data = await resp.json()
        if not isinstance(data, dict) or "reward" not in data:
            raise RuntimeError(f"reward model {self.url} answered {str(data)[:200]!r} without a 'reward' key")
        return data

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
