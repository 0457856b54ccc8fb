"""RLModel on one rank (the tiny CPU demo's layout): HF parity, export, steps, critic, routing replay.

Everything runs in one spawned rank (run_distributed_test, world_size=1) so Megatron's global state
and the CPU shim never touch the pytest process; each test asserts one observation.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel.distributed import run_distributed_test


def _hf_reference(model_dir, batches):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for b in batches:
            logits = model(b.tokens).logits.float()
            logp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, b.tokens[:, 1:, None]).squeeze(-1)
            ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)[:, :-1]
            out.append((logp, ent))
    return out


def _recorded_routes(model, batch):
    from parallel.routing_replay import record_routes

    module = model.modules[0]
    tokens = batch.tokens
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        rec = record_routes(model.modules, lambda: module(tokens, pos, None))
    rows, seq = tokens.shape
    return torch.stack([r.reshape(seq, rows, -1).transpose(0, 1) for r in rec], dim=2).int()


def _routing_maps(model):
    maps = []
    hooks = [m.register_forward_hook(lambda mod, args, out: maps.append(out[1].detach().clone()))
             for m in model.modules[0].modules() if type(m).__name__ == "TopKRouter"]
    return maps, hooks


def _observe(model_dir: str) -> dict:
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.rl_model import RLModel

    obs = {}
    hf = load_file(f"{model_dir}/model.safetensors")
    batches = lc.fixed_batches(105, num=2, seq=12)
    model = RLModel.build(lc.make_recipe(model_dir, {}), "policy")
    model.load_hf_state_dict(hf)
    ours = model.compute_logprobs(batches)
    ref = _hf_reference(model_dir, batches)
    obs["logp_vs_hf"] = max(float((o[0][:, 1:] - r[0]).abs().max()) for o, r in zip(ours, ref))
    obs["entropy_vs_hf"] = max(float((o[1][:, 1:] - r[1]).abs().max()) for o, r in zip(ours, ref))
    obs["position0_zero"] = all(float(o[0][:, 0].abs().max()) == 0.0 for o in ours)
    exported = dict(model.export_hf())
    obs["export_names_equal"] = set(exported) == set(hf)
    obs["export_exact"] = all(torch.equal(exported[k], hf[k]) for k in hf)
    # without a snapshot (the broadcast sender): the same tensors, those needing no conversion as views
    params = {p.untyped_storage().data_ptr() for m in model.modules for p in m.parameters()}
    views = dict(model.export_hf(snapshot=False))
    obs["views_exact"] = set(views) == set(hf) and all(torch.equal(views[k], hf[k]) for k in hf)
    obs["views_of_params"] = sum(t.untyped_storage().data_ptr() in params for t in views.values())
    obs["snapshot_of_params"] = sum(t.untyped_storage().data_ptr() in params for t in exported.values())
    obs["exported"] = len(exported)

    # routing replay: the router's own routes replay bit-exactly; forced routes reach the routing map
    recorded = _recorded_routes(model, batches[0])
    replayed = model.compute_logprobs([replace(batches[0], routed_experts=recorded)])[0][0]
    obs["replay_recorded_exact"] = torch.equal(replayed, ours[0][0])
    forced = lc.fixed_batches(105, num=1, seq=12, seed=3, num_layers=4, top_k=2)[0]
    forced = replace(forced, tokens=batches[0].tokens)
    maps, hooks = _routing_maps(model)
    model.compute_logprobs([forced])
    for h in hooks:
        h.remove()
    expect = [torch.zeros(12 * 2, 8, dtype=torch.bool).scatter_(1, forced.routed_experts[:, :, l].transpose(0, 1)
              .reshape(-1, 2).long(), True) for l in range(4)]
    obs["forced_in_routing_map"] = all(torch.equal(m.bool(), e) for m, e in zip(maps, expect))

    # steps: metrics, replay agreement, non-finite skip
    step = model.train_step([replace(b, routed_experts=recorded) if i == 0 else b for i, b in enumerate(batches)],
                            lc.policy_gradient_loss)
    obs["step"] = step
    random_routes = model.train_step([forced], lc.policy_gradient_loss)
    obs["random_route_agreement"] = random_routes["route_agreement"]
    before = [p.detach().clone() for p in model.modules[0].parameters()]
    nan_loss = lambda b, o: replace(lc.policy_gradient_loss(b, o), loss=lc.policy_gradient_loss(b, o).loss * float("nan"))
    skipped = model.train_step(batches, nan_loss)
    obs["nan_skipped"] = skipped["skipped"]
    obs["nan_params_unchanged"] = all(torch.equal(a, p) for a, p in zip(before, model.modules[0].parameters()))
    after = model.train_step(batches, lc.policy_gradient_loss)
    obs["after_skip_applied"] = after["skipped"] == 0.0 and after["grad_norm"] > 0

    # metrics over the two micro-batches: sums, except *_max / *_min, and the explained variance of the step
    calls = []

    def probing(b, o):
        out = lc.policy_gradient_loss(b, o)
        calls.append(len(calls) + 1)
        i = float(calls[-1])   # 1.0, then 2.0; each micro-batch holds half the step's token-weighted moments
        return replace(out, metrics={**out.metrics, "probe": i, "probe_max": i, "probe_min": i,
                                     "vf_explained_var": 0.9, "return_mean": 0.25, "return_sq_mean": 0.25,
                                     "vf_resid_mean": 0.0, "vf_resid_sq_mean": 0.0625})
    obs["probe_step"] = model.train_step(batches, probing)
    # critic: frozen attention stays bit-identical, value loss falls on a fixed batch
    critic = RLModel.build(lc.make_recipe(model_dir, {}), "critic")
    critic.load_hf_state_dict(hf)
    frozen = {n: p.detach().clone() for n, p in critic.modules[0].named_parameters() if "self_attention" in n}
    obs["critic_frozen_count"] = len(frozen)
    target = [replace(b, returns=b.loss_mask * 0.5) for b in batches]
    losses = [critic.train_step(target, lc.value_loss)["value_loss"] for _ in range(4)]
    obs["value_losses"] = losses
    obs["attention_bit_identical"] = all(torch.equal(frozen[n], p) for n, p in critic.modules[0].named_parameters()
                                         if n in frozen)
    values = critic.compute_values(batches)
    obs["values_shape"] = [tuple(v.shape) for v in values]
    return obs


@pytest.fixture(scope="module")
def observed(tiny_model_dir) -> dict:
    return run_distributed_test(_observe, world_size=1, timeout_s=400, args=(str(tiny_model_dir),))[0]


def test_logprobs_and_entropy_match_hf_transformers(observed):
    # Same fp32 math in a different kernel order: agreement to ~1e-6 (notes report ~3e-6).
    assert observed["logp_vs_hf"] < 1e-5 and observed["entropy_vs_hf"] < 1e-5
    assert observed["position0_zero"]


def test_export_hf_round_trips_exactly(observed):
    assert observed["export_names_equal"] and observed["export_exact"]


def test_export_without_a_snapshot_yields_views_of_the_parameters_where_nothing_is_converted(observed):
    """snapshot=False (the broadcast sender) gives the same tensors; norms, routers, experts' gate/up/down
    are views of the live parameters (no copy); q/k/v, which the export reorders, are copies either way."""
    assert observed["views_exact"] and observed["snapshot_of_params"] == 0
    assert observed["exported"] / 2 < observed["views_of_params"] < observed["exported"]


def test_replaying_recorded_routes_is_bit_exact(observed):
    assert observed["replay_recorded_exact"]
    assert observed["step"]["route_agreement"] == 1.0


def test_forced_routes_appear_in_routing_map(observed):
    assert observed["forced_in_routing_map"]
    assert observed["random_route_agreement"] < 0.5


def test_train_step_metrics(observed):
    step = observed["step"]
    assert step["skipped"] == 0.0 and step["lr"] == 1e-3 and 0 < step["grad_norm"] < 1e3
    assert step["loss"] == pytest.approx(step["pg_loss"] - 0.01 * step["entropy"], abs=1e-6)


def test_train_step_combines_micro_batch_metrics_by_the_algorithm_librarys_rules(observed):
    """Sums, except *_max (max) and *_min (min); the explained variance is the step's, from the summed
    moments (returns var 0.25, residual var 0.125 -> 0.5), not a sum of per-micro-batch values (1.8)."""
    step = observed["probe_step"]
    assert (step["probe"], step["probe_max"], step["probe_min"]) == (3.0, 2.0, 1.0)
    assert step["vf_explained_var"] == pytest.approx(0.5)


def test_non_finite_loss_skips_step_and_keeps_params(observed):
    assert observed["nan_skipped"] == 1.0 and observed["nan_params_unchanged"]
    assert observed["after_skip_applied"]


def test_frozen_attention_critic(observed):
    assert observed["critic_frozen_count"] == 4 * 4  # qkv, proj, q/k norm per layer
    assert observed["attention_bit_identical"]
    losses = observed["value_losses"]
    assert losses[-1] < losses[0] and all(b < a for a, b in zip(losses, losses[1:]))
    assert observed["values_shape"] == [(2, 12), (2, 12)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusals")
def test_gpu_only_optimizer_options_are_one_line_errors_on_cpu(tiny_model_dir):
    from parallel import layout_check as lc
    from parallel.rl_model import RLModel
    from sao_megatron.core.config import ConfigError

    recipe = lc.make_recipe(tiny_model_dir, {"distributed_optimizer": True, "optimizer_offload": True})
    with pytest.raises(ValueError, match=r"^parallel.optimizer_offload needs CUDA .*fix: set parallel.optimizer_offload = false"):
        RLModel.build(recipe, "policy")
    recipe = lc.make_recipe(tiny_model_dir, {"distributed_optimizer": True})
    recipe.checkpoint.format = "distributed"
    with pytest.raises(ValueError, match=r"fix: set checkpoint.format = 'per_rank'"):
        RLModel.build(recipe, "policy")
    recipe.parallel = replace(recipe.parallel, distributed_optimizer=False, optimizer_offload=True)
    with pytest.raises(ConfigError, match="parallel.optimizer_offload.*distributed_optimizer = true"):
        recipe.parallel.check("parallel")


def _park_between_steps(model_dir: str, park: bool) -> dict:
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    hf = load_file(f"{model_dir}/model.safetensors")
    out = {}
    for role, loss in (("critic", lc.value_loss), ("policy", lc.policy_gradient_loss)):
        teardown_model_parallel()
        recipe = lc.make_recipe(model_dir, {}, lr=1e-2)   # the critic keeps attention frozen (not in DDP buffers)
        model = RLModel.build(recipe, role)
        model.load_hf_state_dict(hf)
        batches = lc.fixed_batches(105, num=4, seq=12)
        steps = [model.train_step(batches[:2], loss)]
        freed = None
        if park:
            model.park()
            freed = (model.parking.parked_bytes,
                     all(p.untyped_storage().nbytes() == 0 for c in model.modules for p in c.parameters()))
        steps.append(model.train_step(batches[2:], loss))   # brings the model back first
        out[role] = {"steps": [(m["loss"], m["grad_norm"]) for m in steps], "freed": freed,
                     "weights": {n: t.clone() for n, t in model.export_hf()}}
    teardown_model_parallel()
    return out


def test_parking_frees_the_model_and_restores_it_bit_for_bit(tiny_model_dir):
    """critic.placement = swap: a parked model holds no storage; the next step brings weights, DDP
    buffers and Adam state back exactly (same losses, grad norms and weights as never parking)."""
    ref = run_distributed_test(_park_between_steps, world_size=1, timeout_s=600, args=(str(tiny_model_dir), False))[0]
    got = run_distributed_test(_park_between_steps, world_size=1, timeout_s=600, args=(str(tiny_model_dir), True))[0]
    for role in ("critic", "policy"):
        parked_bytes, all_freed = got[role]["freed"]
        assert parked_bytes > 3 * sum(t.numel() * t.element_size() for t in ref[role]["weights"].values()) and all_freed
        assert got[role]["steps"] == ref[role]["steps"]
        assert all(torch.equal(got[role]["weights"][n], t) for n, t in ref[role]["weights"].items())
