"""Reference-server parts in process: sampling, HF-name mapping, bucket layout, request parsing."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from rollout.engines.reference_server.protocol import BadRequest, parse_generate, version_spans
from rollout.engines.reference_server.sampling import SamplingParams, make_generator, sample_token, truncated_probs
from rollout.engines.reference_server.weight_group import flatten_bucket, unflatten_bucket
from rollout.engines.reference_server.weights import UnknownWeightError, WeightMap, parse_dtype

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(top_p=0.7), [0.625, 0.375, 0, 0]),            # smallest prefix with mass >= 0.7
    (SamplingParams(top_k=3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    (SamplingParams(min_p=0.4), [0.625, 0.375, 0, 0]),            # keep p >= 0.4 * 0.5
    (SamplingParams(top_p=0.4, top_k=3), [1, 0, 0, 0]),
    (SamplingParams(), [0.5, 0.3, 0.15, 0.05]),
])
def test_truncation_hand_computed(params, expected):
    assert torch.allclose(truncated_probs(PROBS.log(), params), torch.tensor(expected, dtype=torch.float32), atol=1e-6)


def test_sampled_logprob_is_untruncated_and_seeded():
    logprobs = PROBS.log()
    params = SamplingParams(top_k=2, sampling_seed=5)
    draws = [sample_token(logprobs, params, make_generator(5)) for _ in range(3)]
    assert len(set(draws)) == 1                                      # same seed, same token
    gen = make_generator(0)
    counts = torch.zeros(4)
    for _ in range(4000):
        token, lp = sample_token(logprobs, params, gen)
        assert math.isclose(lp, math.log(PROBS[token]), rel_tol=1e-6)   # log p, not log(p / 0.8)
        counts[token] += 1
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / 4000 - 0.625) < 0.03                      # 4 sigma of a binomial(4000, .625)
    greedy = sample_token(logprobs, SamplingParams(temperature=0.0), gen)
    assert greedy == (0, pytest.approx(math.log(0.5)))


def test_weight_map_resolves_every_checkpoint_name(tiny_model_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = WeightMap(model)
    on_disk = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, tensor in on_disk.items():
        assert torch.equal(weights.resolve(name), tensor), name
    name = "model.layers.2.mlp.experts.4.up_proj.weight"
    before = model.model.layers[2].mlp.experts.gate_up_proj.detach().clone()
    new = torch.randn(on_disk[name].shape)
    weights.load(name, new)
    after = model.model.layers[2].mlp.experts.gate_up_proj.detach()
    assert torch.equal(after[4, 64:], new)                         # up is the second half of expert 4
    changed = (after != before).any(-1)
    assert changed[4, 64:].all() and changed.sum() == 64              # nothing else moved
    with pytest.raises(ValueError, match="shape"):
        weights.load(name, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="dtype"):
        weights.load(name, new.to(torch.bfloat16))
    with pytest.raises(UnknownWeightError, match="expert 8 >= num_experts 8"):
        weights.resolve("model.layers.0.mlp.experts.8.gate_proj.weight")
    with pytest.raises(UnknownWeightError, match="not a parameter"):
        weights.resolve("model.layers.0.mlp.shared_expert.weight")


def test_flattened_bucket_round_trip_is_bit_exact():
    tensors = [torch.randn(3, 5).to(torch.bfloat16), torch.randn(7), torch.arange(6).reshape(2, 3),
               torch.randn(2, 2).to(torch.float16)]
    flat = flatten_bucket(tensors)
    assert flat.dtype == torch.uint8 and flat.numel() == 30 + 28 + 48 + 8
    names = [f"t{i}" for i in range(4)]
    back = unflatten_bucket(flat, names, [t.dtype for t in tensors], [list(t.shape) for t in tensors])
    for (name, got), want in zip(back, tensors):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    with pytest.raises(ValueError, match="bytes"):
        unflatten_bucket(flat[:-1], names, [t.dtype for t in tensors], [list(t.shape) for t in tensors])
    assert parse_dtype("torch.bfloat16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="not a torch dtype"):
        parse_dtype("floaty")


def _parse(body, **kw):
    return parse_generate(body, vocab_size=100, max_context=50, tokenizer=None, eos_ids=[2], has_routers=True, **kw)


@pytest.mark.parametrize("body, needle", [
    ([1, 2], "JSON object"),
    ({"input_ids": [[1, 2]]}, "batched requests"),
    ({"text": "hi"}, "no tokenizer"),
    ({}, "one of 'input_ids' or 'text'"),
    ({"input_ids": [1], "stream": True}, "streaming"),
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "n must be 1"),
    ({"input_ids": [1], "sampling_params": {"stop": ["x"]}}, "stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": True}}, "max_new_tokens' must be int"),
    ({"input_ids": [1], "logprob_start_len": 0}, "prompt-token logprobs"),
    ({"input_ids": [1], "routed_experts_start_len": 2}, "routed_experts_start_len"),
    ({"input_ids": list(range(50))}, "longer than the model.s context length"),
    ({"input_ids": list(range(40)), "sampling_params": {"max_new_tokens": 11}}, "a total of 51 tokens: 40 tokens"),
])
def test_parse_generate_rejects_with_field_names(body, needle):
    with pytest.raises(BadRequest, match=needle):
        _parse(body)


def test_parse_generate_defaults_and_spans():
    parsed = _parse({"rid": "a", "input_ids": [3, 4], "sampling_params": {"temperature": 0.5, "sampling_seed": 9},
                     "return_logprob": True, "logprob_start_len": -1, "return_routed_experts": True})
    assert parsed.rid == "a" and parsed.params.temperature == 0.5 and parsed.params.sampling_seed == 9
    assert parsed.params.max_new_tokens == 128 and parsed.return_routes and parsed.routes_start == 0
    assert version_spans([0, 0, 1, 1, 1, 3]) == [{"version": "0", "start": 0, "end": 2},
                                                 {"version": "1", "start": 2, "end": 5},
                                                 {"version": "3", "start": 5, "end": 6}]


def test_group_formation_times_out_with_a_clear_error():
    import socket

    from rollout.engines.reference_server.weight_group import init_weight_update_group

    with socket.socket() as sock:   # nobody hosts the store on this port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RuntimeError, match=rf"group 'g_timeout' at tcp://127.0.0.1:{port} \(rank 1/2, gloo\) "
                                           r"did not form within 2s"):
        init_weight_update_group("127.0.0.1", port, 1, 2, "g_timeout", "gloo", timeout_s=2)


def test_update_lock_lets_a_waiting_writer_go_before_new_readers():
    import asyncio

    from rollout.engines.reference_server.gate import ReadWriteLock

    async def scenario():
        lock, order, reader_in = ReadWriteLock(), [], asyncio.Event()

        async def first_reader():
            async with lock.reader():
                reader_in.set()
                await asyncio.sleep(0.05)
                order.append("reader1")

        async def writer():
            await reader_in.wait()
            async with lock.writer():
                order.append("writer")

        async def late_reader():   # arrives while the writer waits: must queue behind it
            await reader_in.wait()
            await asyncio.sleep(0.01)
            async with lock.reader():
                order.append("reader2")
        await asyncio.gather(first_reader(), writer(), late_reader())
        return order, lock.locked

    order, locked = asyncio.run(scenario())
    assert order == ["reader1", "writer", "reader2"] and not locked


def test_serve_options_name_the_bad_flag_or_variable(tiny_model_dir, monkeypatch):
    from rollout.engines.reference_server.server import ServeOptions, check_options

    with pytest.raises(ValueError, match=r"--tp 0 < 1"):
        check_options(ServeOptions(model=str(tiny_model_dir), tp=0))
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "2.5")
    with pytest.raises(ValueError, match="SGLANG_HEALTH_CHECK_TIMEOUT='2.5' is not an integer"):
        check_options(ServeOptions(model=str(tiny_model_dir)))
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "2")
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "maybe")
    with pytest.raises(ValueError, match="SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION='maybe' is not a boolean"):
        check_options(ServeOptions(model=str(tiny_model_dir)))


def test_model_runner_leaves_the_callers_grad_mode_alone(tiny_model_dir):
    """Grad mode is per thread: a runner built in a trainer's or test's thread must not turn autograd
    off there (the full suite once failed a later Megatron build for that), yet never records a graph."""
    import torch

    from rollout.engines.reference_server.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, max_batch=2)
    assert torch.is_grad_enabled()
    out = runner.forward([[1, 2, 3]], [0])
    logits, _ = runner.teacher_forced([1, 2, 3])
    assert torch.is_grad_enabled()
    assert not out.last_logits.requires_grad and not logits.requires_grad
