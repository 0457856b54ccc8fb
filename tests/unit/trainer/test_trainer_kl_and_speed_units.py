"""Hand-computed vectors for the KL estimators under verl's and slime's names, the KL reward penalty the
loop applies, the recipe errors of the KL and learning-rate fields, and the speed metrics' arithmetic."""
from __future__ import annotations

import json

import pytest
import torch

from sao_megatron.algorithms.kl import kl_estimate
from sao_megatron.core.config import ConfigError, load_recipe
from sao_megatron.core.records import AdvantageBatch, Sample, SampleStatus, TrainBatch
from sao_megatron.trainer import steps
from sao_megatron.trainer.speed import SpeedMeter, StepClock, pad_fraction

T = torch.tensor


def _recipe(*overrides):
    return load_recipe(None, ["model.path='unused'", *overrides], check_files=False)


def test_estimators_by_verl_and_slime_names():
    # logp -1, ref -1.2: d = ref - logp = -.2 -> k1 .2, k2 .02, k3 e^-.2 + .2 - 1 = .018731
    # logp -15, ref -1: d = 14 -> k3 = e^14 - 15 = 1202589.28; low_var_kl clamps it to 10
    logp, ref = T([-1.0, -15.0]), T([-1.2, -1.0])
    assert torch.allclose(kl_estimate(logp, ref, "kl"), T([0.2, -14.0]))            # verl's k1
    assert torch.allclose(kl_estimate(logp, ref, "mse"), T([0.02, 98.0]))           # verl's k2
    assert torch.allclose(kl_estimate(logp, ref, "k3"), T([0.018731, 1202589.28]), rtol=1e-5, atol=1e-6)
    assert torch.allclose(kl_estimate(logp, ref, "low_var_kl"), T([0.018731, 10.0]), atol=1e-6)


def test_kl_in_reward_subtracts_the_penalty_on_action_tokens_and_reports_its_mean():
    # rewards [[0, 1, 0(pad)]], k2 of logp - ref = [.5, -.25] -> [.125, .03125]; coef .1 -> [-.0125, .996875, 0]
    cfg = _recipe("algorithm.kl_coef=0.1", "algorithm.kl_estimator='k2'", "algorithm.kl_in='reward'").algorithm
    batch = AdvantageBatch(token_rewards=T([[0.0, 1.0, 0.0]]), mask=T([[1.0, 1.0, 0.0]]), values=None,
                           seq_rewards=T([1.0]), group_ids=T([0]), response_lengths=T([2.0]))
    out, metrics = steps.kl_in_reward(cfg, batch, T([[-1.0, -2.0, 5.0]]), T([[-1.5, -1.75, 0.0]]))
    assert torch.allclose(out.token_rewards, T([[-0.0125, 0.996875, 0.0]]))
    assert metrics["ref_kl"] == pytest.approx((0.125 + 0.03125) / 2)
    assert steps.renamed_kl({"kl": 0.5, "loss": 1.0}) == {"ref_kl": 0.5, "loss": 1.0}


@pytest.mark.parametrize("override, field", [
    (["algorithm.lr=1e-6", "algorithm.lr_min=1e-5"], "algorithm.lr_min"),
    (["critic.lr=1e-6", "critic.lr_min=1e-5"], "critic.lr_min"),
    (["run.num_steps=4", "algorithm.lr_warmup_steps=4"], "algorithm.lr_warmup_steps"),
    (["algorithm.lr_schedule='step'"], "algorithm.lr_schedule"),
    (["algorithm.kl_in='advantage'"], "algorithm.kl_in"),
    (["algorithm.kl_estimator='k4'"], "algorithm.kl_estimator"),
])
def test_bad_kl_and_lr_fields_are_one_line_recipe_errors(override, field):
    with pytest.raises(ConfigError) as err:
        _recipe(*override)
    assert err.value.field == field and "\n" not in str(err.value)


def test_a_missing_reference_model_is_a_recipe_error(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_recipe(None, [f"model.path='{tiny_model_dir}'", f"run.output_dir='{tmp_path}'", "algorithm.kl_coef=0.01",
                           f"algorithm.ref_model_path='{tmp_path / 'nowhere'}'"])
    assert err.value.field == "algorithm.ref_model_path"
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
    with pytest.raises(ConfigError, match="differs from model.path in hidden_size") as err:
        load_recipe(None, [f"model.path='{tiny_model_dir}'", f"run.output_dir='{tmp_path}'", "algorithm.kl_coef=0.01",
                           f"algorithm.ref_model_path='{other}'"])
    assert err.value.field == "algorithm.ref_model_path"


def _batch(lengths: list[int], width: int) -> TrainBatch:
    rows = len(lengths)
    zeros = torch.zeros(rows, width)
    return TrainBatch(tokens=torch.zeros(rows, width, dtype=torch.long), lengths=T(lengths), loss_mask=zeros,
                      rollout_logprobs=zeros, advantages=zeros, returns=zeros,
                      weight_versions=torch.zeros(rows, width, dtype=torch.long))


def test_pad_fraction_counts_padding_slots_over_computed_slots():
    # batch 1: 2 rows x 8 = 16 slots, 8 + 4 real; batch 2: 1 x 5, 5 real -> 4 padding of 21
    assert pad_fraction([_batch([8, 4], 8), _batch([5], 5)]) == pytest.approx(4 / 21)


def test_stale_drop_rate_is_per_step_from_the_drivers_cumulative_counters():
    meter = SpeedMeter(None, 1)
    meter.start_counting({"rollout/dropped_stale": 2, "rollout/finished": 10})   # a resumed driver's counts
    assert meter.stale_drop_rate({"rollout/dropped_stale": 5, "rollout/finished": 20}) == pytest.approx(0.3)
    assert meter.stale_drop_rate({"rollout/dropped_stale": 5, "rollout/finished": 30}) == 0.0
    assert meter.stale_drop_rate({}) == 0.0   # a source without the counters (saved rollouts)


def test_train_tflops_uses_the_planners_flop_model(tiny_model_dir):
    from parallel.planner.timing import forward_flops_per_token

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    samples = [Sample(uid=f"s{i}", prompt_index=i, prompt_ids=[1] * 3, response_ids=[2] * n,
                      status=SampleStatus.COMPLETED) for i, n in enumerate((2, 7))]
    clock = StepClock()
    clock.seconds["policy"], clock.passes = 2.0, 3
    out = SpeedMeter(cfg, world_size=2).step_metrics(clock, samples, step_seconds=4.0, batches=None)
    flops = 3 * (forward_flops_per_token(cfg, 5) * 5 + forward_flops_per_token(cfg, 10) * 10)
    assert out["perf/train_tflops"] == pytest.approx(flops / 2.0 / 2 / 1e12)
    assert out["perf/tokens_per_s"] == pytest.approx(15 / 4.0)
    assert out["perf/time/policy_s"] == 2.0 and out["perf/time/critic_s"] == 0.0


def test_sao_plan_counts_the_kl_reference_parked_in_host_memory(tiny_model_dir, tmp_path):
    from dataclasses import replace

    from parallel.planner import GIB, RUNTIME_RESERVE_GIB, make_plan, plan_input_from_recipe

    recipe = load_recipe(None, [f"model.path='{tiny_model_dir}'", f"run.output_dir='{tmp_path}'",
                                "algorithm.kl_coef=0.01"])
    inp = plan_input_from_recipe(recipe, gpus=2, gpu="h100")
    assert inp.reference
    without, with_ref = make_plan(replace(inp, reference=False)), make_plan(inp)
    weights = with_ref.policy.weights
    assert with_ref.reference == weights > 0 and without.reference == 0
    assert with_ref.host_per_gpu == pytest.approx(without.host_per_gpu + weights)
    # its pass: the resident models without activations + its weights + a forward pass's activations
    resident = sum(m.total - m.activations for m in (with_ref.policy, with_ref.critic))
    ref_pass = resident + weights + with_ref.policy.activations
    assert with_ref.trainer_total == pytest.approx(max(without.trainer_total, ref_pass + RUNTIME_RESERVE_GIB * GIB))


def test_engine_load_reads_sglang_v1_loads_and_the_reference_server_answers_it(monkeypatch):
    import asyncio
    from types import SimpleNamespace

    from rollout.engines.reference_server.app import loads
    from rollout.engines.sglang_client import SGLangEngine
    from sao_megatron.trainer.speed import engine_load_metrics

    # SGLang 0.5.23's reply shape (entrypoints/v1_loads.py:136), two DP ranks
    reply = {"version": "0.5.23", "loads": [
        {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1, "token_usage": 0.25, "gen_throughput": 100.0},
        {"dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 0, "token_usage": 0.5, "gen_throughput": 50.0}]}
    engine = SGLangEngine("http://sglang:30000")

    async def canned(method, path, body, timeout_s):
        assert (method, path) == ("GET", "/v1/loads?include=core")
        return reply

    monkeypatch.setattr(engine, "_ok", canned)

    class Silent:
        async def load(self):
            raise ConnectionError("down")

    metrics = asyncio.run(engine_load_metrics([engine, Silent(), object()]))
    assert metrics == {"engine/running_requests": 5.0, "engine/queued_requests": 1.0, "engine/kv_usage": 0.5,
                       "engine/gen_throughput_tok_s": 150.0}
    assert asyncio.run(engine_load_metrics([object()])) == {}

    # the reference server answers the same route with SGLang's field names (a KV slot per running request)
    state = SimpleNamespace(scheduler=SimpleNamespace(stats=lambda: {"running": 2, "waiting": 5}),
                            runner=SimpleNamespace(max_batch=8))
    answer = json.loads(asyncio.run(loads(state, None)).text)["loads"][0]
    assert answer["num_running_reqs"] == 2 and answer["num_waiting_reqs"] == 5 and answer["token_usage"] == 0.25


def test_sglang_0_5_23_serves_v1_loads_with_the_fields_the_client_reads():
    import ast

    from sglang_wheel import load_sources

    sources = load_sources()
    assert '@router.get("/v1/loads")' in sources["sglang/srt/entrypoints/v1_loads.py"]
    tree = ast.parse(sources["sglang/srt/managers/load_snapshot.py"])
    snapshot = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LoadSnapshot")
    fields = {s.target.id for s in snapshot.body if isinstance(s, ast.AnnAssign)}
    assert {"num_running_reqs", "num_waiting_reqs", "token_usage", "gen_throughput"} <= fields
