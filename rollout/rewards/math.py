"""Math answers checked with math-verify (HF): 1.0 if the response's final answer equals the label.

math-verify's own timeouts use signals, which only work in the main thread; rewards run in worker
threads, so both are disabled here (parsing_timeout=None, timeout_seconds=None) and the driver's
``rollout.reward_timeout_s`` bounds the call instead.
"""
from __future__ import annotations

from sao_megatron.core.records import Sample


def _math_verify():
    try:
        import math_verify
    except ImportError as exc:
        raise ImportError("math rewards need math-verify: pip install 'math-verify[antlr4_13_2]'") from exc
    return math_verify


def verify_answer(response: str, label) -> float:
    mv = _math_verify()
    gold = mv.parse(str(label) if "$" in str(label) or "\\" in str(label) else f"${label}$",
                    parsing_timeout=None)
    pred = mv.parse(response, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if mv.verify(gold, pred, timeout_seconds=None) else 0.0


def math_reward(sample: Sample) -> float:
    if sample.label is None:
        raise ValueError(f"sample {sample.uid} has no label; math rewards need an 'answer' field in the dataset")
    return verify_answer(sample.response_text, sample.label)
