"""Full activation recompute replays each micro-batch's own routes (2 ranks, gloo).

Recompute re-runs the router during backward. Under 1F1B (pp2), interleaved 1F1B (vpp2) and no
pipelining (dp2: pp = 1, two micro-batches per rank) the routers must replay, in each recompute, the
routes of the micro-batch being back-propagated, not those of the micro-batch forwarded last. The
observable: gradients with model.recompute = full equal those without (fp32, CPU: bit for bit here;
asserted to 1e-6), and every REPLAY_BACKWARD call returns exactly the experts its forward replayed.
The model is the tiny GLM-4.5 (layer 0 dense), so the layer axis is checked across stages too.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel.distributed import run_distributed_test

LAYOUTS = {"pp2": dict(pp=2), "vpp2": dict(pp=2, vpp=2), "dp2": dict()}


@pytest.fixture(scope="module")
def tiny_glm_dir(tmp_path_factory):
    from checkpoints.tiny_models import make_tiny_hf

    return make_tiny_hf(tmp_path_factory.mktemp("glm45") / "model", "glm4_moe")


def _batches():
    """Four micro-batches, each with its own random routes except the third (routers choose)."""
    from parallel import layout_check as lc

    batches = lc.fixed_batches(105, num=4, seq=12, seed=1, num_layers=4, top_k=2, dense_layers=1)
    return [replace(b, routed_experts=None) if i == 2 else b for i, b in enumerate(batches)]


def _spy(model) -> dict[int, list]:
    """Per global layer: (action name, experts) of every top-k call of its router, in call order."""
    from parallel.routing_replay import routers_of

    log: dict[int, list] = {}
    for chunk in model.modules:
        for layer, router in routers_of(chunk):
            replay, calls = router.router_replay, log.setdefault(layer, [])
            original = replay.get_replay_topk

            def spy(*args, _replay=replay, _original=original, _calls=calls, **kwargs):
                action = _replay.router_replay_action.name if _replay.router_replay_action else None
                result = _original(*args, **kwargs)
                _calls.append((action, result[1].detach().clone()))
                return result

            replay.get_replay_topk = spy
    return log


def _grads(model) -> list[torch.Tensor]:
    return [p.main_grad.detach().clone() for m in model.modules for p in m.parameters() if p.requires_grad]


def _expected_targets(batch, layer: int) -> torch.Tensor:
    """The experts the router of `layer` must replay for `batch` (whole sequence, no SP): column
    `layer` in Megatron's [s, b] token order, placeholders 0..k-1 where no route was recorded."""
    from parallel.routing_replay import _fill_missing

    local = batch.routed_experts.transpose(0, 1).reshape(-1, *batch.routed_experts.shape[2:])
    return _fill_missing(local[:, layer].long(), 2)[0]


def _run(model_dir: str, layouts: dict) -> dict:
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    hf = load_file(f"{model_dir}/model.safetensors")
    out = {}
    for name, layout in layouts.items():
        runs = {}
        for recompute in ("none", "full"):
            teardown_model_parallel()
            recipe = lc.make_recipe(model_dir, layout)
            recipe.model.recompute = recompute
            model = RLModel.build(recipe, "policy")
            model.load_hf_state_dict(hf)
            local = lc.dp_shard(_batches())
            log = _spy(model)
            metrics = model.train_step(local, lc.policy_gradient_loss)
            runs[recompute] = {"metrics": metrics, "grads": _grads(model), "log": log, "local": local}
        out[name] = _summarise(runs)
    teardown_model_parallel()
    return out


def _summarise(runs: dict) -> dict:
    plain, full = runs["none"], runs["full"]
    routed = [b for b in full["local"] if b.routed_experts is not None]
    summary = {"grad_delta": max(float((a - b).abs().max()) for a, b in zip(plain["grads"], full["grads"])),
               "agreement": (plain["metrics"].get("route_agreement"), full["metrics"].get("route_agreement")),
               "layers": sorted(full["log"]), "backward_calls_without_recompute": 0, "layer_checks": {}}
    for layer, calls in full["log"].items():
        forward = [e for action, e in calls if action == "REPLAY_FORWARD"]
        backward = [e for action, e in calls if action == "REPLAY_BACKWARD"]
        summary["layer_checks"][layer] = {
            "forward_is_column": [torch.equal(e, _expected_targets(b, layer)) for e, b in zip(forward, routed)],
            "counts": (len(forward), len(backward), len(routed)),
            "recompute_replays_own": [torch.equal(f, b) for f, b in zip(forward, backward)]}
        summary["backward_calls_without_recompute"] += sum(a == "REPLAY_BACKWARD" for a, _ in plain["log"][layer])
    return summary


@pytest.fixture(scope="module")
def observed(tiny_glm_dir):
    return run_distributed_test(_run, world_size=2, timeout_s=600, args=(str(tiny_glm_dir), LAYOUTS))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_recompute_gives_the_gradients_of_no_recompute(observed, name):
    for rank in observed:
        assert rank[name]["grad_delta"] <= 1e-6, (name, rank[name]["grad_delta"])
        plain, full = rank[name]["agreement"]
        assert plain == full and plain is not None


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_recompute_replays_its_own_micro_batch(observed, name):
    stage_layers = set()
    for rank in observed:
        result = rank[name]
        stage_layers.update(result["layers"])
        assert result["backward_calls_without_recompute"] == 0
        for layer, check in result["layer_checks"].items():
            forward, backward, routed = check["counts"]
            assert forward == backward == routed > 0, (name, layer, check["counts"])
            assert all(check["forward_is_column"]), (name, layer)
            assert all(check["recompute_replays_own"]), (name, layer)
    assert stage_layers == {1, 2, 3}   # global MoE layers, across both pipeline stages
