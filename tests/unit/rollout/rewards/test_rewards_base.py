"""RewardFn resolution, safe application (raise / timeout / bad value), math-verify, HTTP reward model."""
from __future__ import annotations

import asyncio
import math
import time

import pytest

from rollout.rewards import apply_reward, resolve_reward_fn
from rollout.rewards.math import math_reward
from rollout.rewards.reward_model import RewardModel
from rollout.rewards.task_reward import task_reward
from sao_megatron.core.config.schema import RolloutConfig
from sao_megatron.core.records import Sample, SampleStatus


def sample(text="7", label="7", **meta):
    return Sample(uid="p0", prompt_index=0, prompt_ids=[1], response_text=text, label=label, prompt_text="q",
                  metadata=dict(meta))


def double_len(s):               # used through its import path below
    return {"reward": 2.0 * len(s.response_text), "chars": len(s.response_text)}


def test_resolve_import_path_task_default_and_math_default():
    assert resolve_reward_fn(RolloutConfig(reward_fn="test_rewards_base:double_len")) is double_len
    assert resolve_reward_fn(RolloutConfig(task="countdown")) is task_reward
    assert resolve_reward_fn(RolloutConfig(task="", dataset="x.jsonl")) is math_reward
    assert resolve_reward_fn(RolloutConfig(task="countdown", dataset="x.jsonl")) is math_reward   # dataset wins


@pytest.mark.parametrize("path,match", [("nodots", "not an import path"), ("no_such_mod_xyz:f", "cannot import"),
                                        ("rollout.rewards.math:nope", "has no 'nope'")])
def test_resolve_errors_name_the_field(path, match):
    with pytest.raises(ValueError, match=f"rollout.reward_fn: .*{match}"):
        resolve_reward_fn(RolloutConfig(reward_fn=path))


def run(fn, s, timeout=1.0):
    return asyncio.run(apply_reward(fn, s, timeout))


def test_apply_reward_dict_keeps_info():
    s = sample("abc")
    assert run(double_len, s) and s.reward == 6.0 and s.reward_info == {"chars": 3}


@pytest.mark.parametrize("fn,reason", [
    (lambda s: 1 / 0, "reward raised ZeroDivisionError"),
    (lambda s: "1.0", "reward raised ValueError: reward is str, expected a float"),
    (lambda s: math.nan, "reward raised ValueError: reward is nan"),
    (lambda s: {"score": 1}, "has no 'reward' key"),
    (lambda s: time.sleep(0.5) or 1.0, "reward timed out after 0.05s"),
])
def test_failures_mark_the_sample_failed_with_reason(fn, reason):
    s = sample()
    assert not run(fn, s, timeout=0.05)
    assert s.status == SampleStatus.FAILED and s.reward is None and reason in s.metadata["error"]


def test_async_reward_timeout():
    async def slow(s):
        await asyncio.sleep(5)
    s = sample()
    assert not run(slow, s, timeout=0.02) and "timed out" in s.metadata["error"]


def test_math_reward_uses_math_verify_in_a_worker_thread():
    s = sample(r"so the answer is $\frac{1}{2}$", "0.5")
    assert run(math_reward, s, timeout=30) and s.reward == 1.0
    s = sample("the answer is 3", "4")
    assert run(math_reward, s, timeout=30) and s.reward == 0.0


def test_http_reward_model_round_trip_and_errors():
    from aiohttp import web

    async def score(request):
        if request.headers.get("Authorization") != "Bearer k":
            return web.Response(status=401, text="bad key")
        body = await request.json()
        if body["response"] == "boom":
            return web.json_response({"nothing": 1})
        return web.json_response({"reward": float(len(body["response"])), "label_seen": body["label"]})

    async def main():
        app = web.Application()
        app.router.add_post("/score", score)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        rm = RewardModel(f"http://127.0.0.1:{port}", timeout_s=5, api_key="k")
        ok, bad, nokey = sample("abcd"), sample("boom"), sample("x")
        await apply_reward(rm, ok, 5)
        await apply_reward(rm, bad, 5)
        await apply_reward(RewardModel(f"http://127.0.0.1:{port}", api_key="wrong"), nokey, 5)
        await rm.close()
        await runner.cleanup()
        return ok, bad, nokey

    ok, bad, nokey = asyncio.run(main())
    assert ok.reward == 4.0 and ok.reward_info == {"label_seen": "7"}
    assert bad.status == SampleStatus.FAILED and "without a 'reward' key" in bad.metadata["error"]
    assert "HTTP 401" in nokey.metadata["error"]


def test_reward_model_from_config_needs_a_url(monkeypatch):
    monkeypatch.delenv("SAO_REWARD_MODEL_URL", raising=False)
    with pytest.raises(ValueError, match="SAO_REWARD_MODEL_URL"):
        resolve_reward_fn(RolloutConfig(reward_fn="rollout.rewards.reward_model:RewardModel"))
    monkeypatch.setenv("SAO_REWARD_MODEL_URL", "http://127.0.0.1:1")
    fn = resolve_reward_fn(RolloutConfig(reward_fn="rollout.rewards.reward_model:RewardModel", reward_timeout_s=3))
    assert isinstance(fn, RewardModel) and fn.url == "http://127.0.0.1:1/score" and fn.timeout_s == 3
