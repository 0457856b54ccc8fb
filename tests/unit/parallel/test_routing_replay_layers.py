"""Routing replay reads SGLang's layer axis: one column per hidden layer, column l = global layer l.

The tiny GLM-4.5 model (checkpoints/tiny_models.py: 4 layers, layer 0 dense, 8 experts top-2) makes
the difference visible: under the old MoE-only convention the router of layer 1 replayed column 0,
which SGLang leaves zero for the dense layer. Routes here give every column its own experts, so each
router's routing map shows which column it replayed. One spawned rank (Megatron state stays out of
the pytest process).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel.distributed import run_distributed_test
from sao_megatron.core.records import Sample

ROWS, SEQ, LAYERS, TOP_K, EXPERTS = 2, 12, 4, 2, 8


@pytest.fixture(scope="module")
def tiny_glm_dir(tmp_path_factory):
    from checkpoints.tiny_models import make_tiny_hf

    return make_tiny_hf(tmp_path_factory.mktemp("glm45") / "model", "glm4_moe")


def column_routes() -> torch.Tensor:
    """[rows, seq, layers, k]: token t of column l routes to experts (t + 3l) % 8 and (t + 3l + 1) % 8
    (distinct per column and per token); column 0, the dense layer, is zero as SGLang returns it."""
    t = torch.arange(SEQ).view(1, SEQ, 1, 1)
    layer = torch.arange(LAYERS).view(1, 1, LAYERS, 1)
    routes = (t + 3 * layer + torch.arange(TOP_K).view(1, 1, 1, TOP_K)) % EXPERTS
    routes = routes.expand(ROWS, SEQ, LAYERS, TOP_K).clone().int()
    routes[:, :, 0] = 0
    return routes


def _observe(model_dir: str) -> dict:
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.rl_model import RLModel
    from parallel.routing_replay import routers_of

    model = RLModel.build(lc.make_recipe(model_dir, {}), "policy")
    model.load_hf_state_dict(load_file(f"{model_dir}/model.safetensors"))
    batch = replace(lc.fixed_batches(105, num=1, rows=ROWS, seq=SEQ)[0], routed_experts=column_routes())
    maps: dict[int, torch.Tensor] = {}
    for layer, router in routers_of(model.modules[0]):
        router.register_forward_hook(lambda mod, args, out, layer=layer: maps.__setitem__(layer, out[1].detach().clone()))
    logp = model.compute_logprobs([batch])[0][0]
    other_dense = batch.routed_experts.clone()
    other_dense[:, :, 0] = torch.tensor([5, 6], dtype=torch.int32)
    logp_other_dense = model.compute_logprobs([replace(batch, routed_experts=other_dense)])[0][0]
    try:
        model.compute_logprobs([replace(batch, routed_experts=batch.routed_experts[:, :, 1:])])
        moe_only_error = ""
    except ValueError as err:
        moe_only_error = str(err)
    return {"maps": maps, "logp_equal_other_dense": torch.equal(logp, logp_other_dense),
            "moe_only_error": moe_only_error}


@pytest.fixture(scope="module")
def observed(tiny_glm_dir):
    return run_distributed_test(_observe, world_size=1, timeout_s=300, args=(str(tiny_glm_dir),))[0]


def test_router_of_layer_l_replays_column_l(observed):
    routes = column_routes()
    assert sorted(observed["maps"]) == [1, 2, 3]      # layer 0 is dense: no router
    for layer, routing_map in observed["maps"].items():
        tokens = routes[:, :, layer].transpose(0, 1).reshape(-1, TOP_K).long()   # Megatron's [s, b] order
        expect = torch.zeros(ROWS * SEQ, EXPERTS, dtype=torch.bool).scatter_(1, tokens, True)
        assert torch.equal(routing_map.bool(), expect), layer


def test_dense_column_is_never_replayed(observed):
    # a zero dense column replayed by layer 1 would route every token to expert 0 alone
    assert observed["maps"][1].sum(dim=1).eq(TOP_K).all()
    assert observed["logp_equal_other_dense"]


def test_moe_only_routes_are_refused(observed):
    assert "one column per hidden layer" in observed["moe_only_error"]
    assert f"[rows, seq, {LAYERS}, top_k]" in observed["moe_only_error"]


def test_sample_refuses_routes_without_a_layer_axis():
    sample = Sample(uid="u", prompt_index=0, prompt_ids=[1, 2], response_ids=[3],
                    loss_mask=[1], rollout_logprobs=[0.0], weight_versions=[0],
                    routed_experts=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        sample.check()


def test_fixed_batches_follow_sglang_layout():
    from parallel import layout_check as lc

    routes = lc.fixed_batches(105, num=1, seq=8, num_layers=4, top_k=2, dense_layers=1)[0].routed_experts
    assert tuple(routes.shape) == (2, 8, 4, 2)
    assert routes[:, :, 0].eq(0).all() and routes[:, :, 1:].ne(routes[:, :, 1:, :1]).any()
