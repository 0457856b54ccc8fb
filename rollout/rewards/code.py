"""Code-execution reward: run the response's program followed by the label's tests in the sandbox.

The program is the last ```python fenced block of the response (or the whole response when there is
none); the label holds test code (e.g. asserts). Reward 1.0 when the combined script exits 0 within
the sandbox limits, else 0.0; ``reward_info`` says which limit was hit and the last stderr line.
"""
from __future__ import annotations

import re

from rollout.sandbox import SandboxLimits, run_python
from sao_megatron.core.records import Sample

FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def extract_program(response: str) -> str:
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else response


async def code_reward(sample: Sample, limits: SandboxLimits = SandboxLimits()) -> dict:
    if not isinstance(sample.label, str):
        raise ValueError(f"sample {sample.uid}: code rewards need test code (a string) as the label")
    result = await run_python(extract_program(sample.response_text) + "\n\n" + sample.label, limits)
    last_err = result.stderr.strip().splitlines()[-1:] or [""]
    return {"reward": 1.0 if result.ok else 0.0, "limit": result.limit or "", "error": last_err[0][:200],
            "network_isolated": result.network_isolated}
