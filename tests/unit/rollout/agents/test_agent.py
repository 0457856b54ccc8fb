"""The multi-turn tool loop: observation masking, submit, budgets, malformed calls, driver integration."""
from __future__ import annotations

import asyncio
import json

from checkpoints.init_model import build_tokenizer
from rollout.agents.tool_loop import ToolAgent, parse_tool_call
from rollout.driver import RolloutDriver
from rollout.prompts import build_prompt_source
from rollout.rewards import resolve_reward_fn
from rollout.engines.scripted import ScriptedEngine as FakeEngine
from sao_megatron.core.config.schema import RolloutConfig
from sao_megatron.core.records import Sample, SampleStatus

TOK = build_tokenizer()


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def scripted(turns):
    """An engine policy: the n-th turn (n = tool responses seen so far) writes turns[n]."""
    def script(input_ids):
        n = TOK.decode(input_ids, skip_special_tokens=False).count("<tool_response>")
        return TOK.encode(turns[min(n, len(turns) - 1)], add_special_tokens=False)
    return script


def run_agent(turns, version=3, **agent_kw):
    engine = FakeEngine("e0", script=scripted(turns), version=version)
    agent = ToolAgent(TOK, **agent_kw)
    sample = Sample(uid="p0", prompt_index=0, prompt_ids=TOK.encode("q:", add_special_tokens=False))

    async def turn(s, max_new, stop_ids):
        from rollout.engines.engine import GenerateRequest
        r = await engine.generate(GenerateRequest("x", s.prompt_ids + s.response_ids, max_new, stop_token_ids=stop_ids))
        s.response_ids += r.output_ids
        s.loss_mask += [1] * len(r.output_ids)
        s.rollout_logprobs += r.output_logprobs
        s.weight_versions += r.output_weight_versions
        return r.finish_reason

    asyncio.run(agent.rollout(sample, turn))
    return sample


def test_python_tool_output_is_an_observation_with_loss_mask_zero():
    first, second = call("python", code="print(6*7)"), call("submit", answer="42")
    s = run_agent([first, second])
    s.check()
    assert s.status == SampleStatus.COMPLETED and s.metadata["submitted"] == "42" and s.metadata["turns"] == 2
    obs = "\n<tool_response>42\n</tool_response>\n"
    n1, n_obs = len(TOK.encode(first)), len(TOK.encode(obs))
    assert s.loss_mask == [1] * n1 + [0] * n_obs + [1] * len(TOK.encode(second))
    assert TOK.decode(s.response_ids[n1:n1 + n_obs], skip_special_tokens=False) == obs
    assert s.rollout_logprobs[n1:n1 + n_obs] == [0.0] * n_obs and set(s.weight_versions) == {3}
    assert "tool_response" not in s.response_text and "42" in s.response_text


def test_turn_budget_truncates_and_skips_the_last_observation():
    s = run_agent([call("python", code="print(1)")], max_turns=2)
    assert s.status == SampleStatus.TRUNCATED and s.metadata["turns"] == 2
    assert s.loss_mask.count(0) == len(TOK.encode("\n<tool_response>1\n</tool_response>\n"))   # one observation only
    assert s.loss_mask[-1] == 1


def test_token_budget_truncates():
    s = run_agent([call("python", code="print('x' * 50)")], max_total_tokens=120, max_turns=10)
    assert s.status == SampleStatus.TRUNCATED and len(s.response_ids) <= 120


def test_malformed_and_unknown_calls_get_error_observations():
    s = run_agent(["<tool_call>{oops</tool_call>", call("search", q="x"), call("python", code="1/0"),
                   call("submit", answer="7")], max_turns=6,
                  max_total_tokens=1024)
    obs = TOK.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0], skip_special_tokens=False)
    assert "error: tool call is not valid JSON" in obs and "unknown tool 'search'" in obs
    assert "ZeroDivisionError" in obs and s.metadata["submitted"] == "7"


def test_plain_answer_without_tools_ends_the_episode():
    s = run_agent(["7<|im_end|>"])
    assert s.status == SampleStatus.COMPLETED and s.response_text == "7" and s.loss_mask.count(0) == 0


def test_parse_tool_call():
    assert parse_tool_call("no call") is None
    c = parse_tool_call('x <tool_call>{"name": "submit", "arguments": {"answer": 1}}')
    assert c.name == "submit" and c.arguments == {"answer": 1} and not c.closed


def test_agent_through_the_driver_scores_the_submitted_answer():
    cfg = RolloutConfig(task="arithmetic", batch_size=4, max_in_flight=4, max_new_tokens=64)

    def script(input_ids):
        text = TOK.decode(input_ids, skip_special_tokens=False)
        question = text.split("user\n")[1].split("<|im_end|>")[0].rstrip("=")
        if "<tool_response>" not in text:
            return TOK.encode(call("python", code=f"print({question})"), add_special_tokens=False)
        answer = text.split("<tool_response>")[1].split("\n")[0]
        return TOK.encode(call("submit", answer=answer), add_special_tokens=False)

    async def main():
        src = build_prompt_source(cfg, TOK, seed=0, num_problems=16)
        d = RolloutDriver([FakeEngine("e0", script=script)], src, resolve_reward_fn(cfg), cfg, TOK, seed=0,
                          agent=ToolAgent(TOK, max_turn_tokens=64))
        await d.start()
        batch = await d.get_batch(4, 0)
        await d.stop()
        return batch

    for s in asyncio.run(main()):
        s.check()
        assert s.reward == 1.0 and s.metadata["submitted"] == s.label and 0 in s.loss_mask


def test_resumed_mid_episode_answers_the_dangling_call_first():
    first, second = call("python", code="print(2+2)"), call("submit", answer="4")
    engine = FakeEngine("e0", script=scripted([first, second]))
    ids = TOK.encode(first, add_special_tokens=False)
    sample = Sample(uid="p0", prompt_index=0, prompt_ids=[1], response_ids=list(ids), loss_mask=[1] * len(ids),
                    rollout_logprobs=[-1.0] * len(ids), weight_versions=[0] * len(ids), metadata={"turns": 1})

    async def turn(s, max_new, stop_ids):
        from rollout.engines.engine import GenerateRequest
        r = await engine.generate(GenerateRequest("x", s.prompt_ids + s.response_ids, max_new, stop_token_ids=stop_ids))
        s.response_ids += r.output_ids
        s.loss_mask += [1] * len(r.output_ids)
        s.rollout_logprobs += r.output_logprobs
        s.weight_versions += r.output_weight_versions
        return r.finish_reason

    asyncio.run(ToolAgent(TOK).rollout(sample, turn))
    sample.check()
    obs = TOK.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if m == 0], skip_special_tokens=False)
    assert obs == "\n<tool_response>4\n</tool_response>\n" and sample.metadata["submitted"] == "4"
    assert sample.metadata["turns"] == 2 and len(engine.rids) == 1


def test_multi_turn_episodes_stay_within_the_context_and_no_request_is_refused():
    """Turn 1 (a 62-token call) and its 65-token observation fit a context of 160 after the 23-token
    prompt; turn 2 is capped to the 10 tokens left (64 would be refused by SGLang), and the
    observation of its cut-off call is not appended: every episode ends TRUNCATED at exactly 160."""
    from context_engine import ContextEngine

    cfg = RolloutConfig(task="arithmetic", batch_size=4, max_in_flight=4, max_new_tokens=64)
    first, context = call("python", code='print("x"*60)'), 23 + 62 + 65 + 10
    engine = ContextEngine("e0", context=context, script=scripted([first, call("submit", answer="1")]))

    async def main():
        src = build_prompt_source(cfg, TOK, seed=0, num_problems=16)
        d = RolloutDriver([engine], src, resolve_reward_fn(cfg), cfg, TOK, seed=0, context_length=context,
                          agent=ToolAgent(TOK, max_turn_tokens=64, max_observation_tokens=100,
                                          context_length=context))
        await d.start()
        batch = await d.get_batch(4, 0)
        counts = dict(d.counts)
        await d.stop()
        return batch, counts

    batch, counts = asyncio.run(main())
    assert counts["failed"] == 0
    assert all(n + m <= context for n, m in engine.requests) and (150, 10) in engine.requests
    for s in batch:
        s.check()
        assert s.status == SampleStatus.TRUNCATED and s.num_tokens == context and s.metadata["turns"] == 2
        assert s.loss_mask.count(0) == 65          # the first observation only
