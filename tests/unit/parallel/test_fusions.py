"""Kernels and fusions per implementation (parallel/fusions.py), and routing replay under each of them.

The kwargs are a pure function, so the Transformer Engine choice is pinned here without TE installed.
Replay is proved at the router: Megatron-Core 0.16.1's top-k with RouterReplay yields (probs, routing_map)
at the replayed experts, and every kernel downstream (permutation, fused or not; grouped GEMM's tokens per
expert; the flex dispatcher's top-k of the probs) reads only that pair; the source pins say so.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from parallel.fusions import DispatcherError, check_dispatcher, kernel_kwargs

GPU_FUSIONS = ("moe_grouped_gemm", "moe_permute_fusion", "bias_activation_fusion")


def test_transformer_engine_runs_the_anchor_kernels():
    kw = kernel_kwargs(use_te=True, mla=False, dispatcher="alltoall", wgrad_kernel=True)
    assert all(kw[name] for name in GPU_FUSIONS)
    assert kw["gradient_accumulation_fusion"] and kw["apply_rope_fusion"]
    assert not kw["moe_router_fusion"]          # the fused top-k never consults RouterReplay
    assert kw["moe_token_dispatcher_type"] == "alltoall" and "moe_flex_dispatcher_backend" not in kw


def test_mla_keeps_rope_unfused_and_wgrad_fusion_needs_its_kernel():
    kw = kernel_kwargs(use_te=True, mla=True, dispatcher="alltoall", wgrad_kernel=False)
    assert all(kw[name] for name in GPU_FUSIONS)
    assert not kw["apply_rope_fusion"] and not kw["gradient_accumulation_fusion"]


def test_local_path_turns_every_fusion_off():
    kw = kernel_kwargs(use_te=False, mla=False, dispatcher="allgather", wgrad_kernel=True)
    fusion_flags = [k for k in kw if k.endswith("fusion") or k in ("moe_grouped_gemm", "persist_layer_norm")]
    assert len(fusion_flags) >= 8 and not any(kw[k] for k in fusion_flags)


def test_flex_selects_deepep_and_is_refused_where_it_cannot_run():
    kw = kernel_kwargs(use_te=True, mla=False, dispatcher="flex")
    assert kw["moe_token_dispatcher_type"] == "flex" and kw["moe_flex_dispatcher_backend"] == "deepep"
    with pytest.raises(DispatcherError, match=r"^parallel.dispatcher = flex needs CUDA; fix:"):
        check_dispatcher("flex", use_te=False, tp=1, ep=2, cuda=False, deep_ep=False)
    with pytest.raises(DispatcherError, match="deep_ep"):
        check_dispatcher("flex", use_te=True, tp=1, ep=2, cuda=True, deep_ep=False)
    with pytest.raises(DispatcherError, match=r"tp \* ep > 1"):
        check_dispatcher("flex", use_te=True, tp=1, ep=1, cuda=True, deep_ep=True)
    check_dispatcher("flex", use_te=True, tp=1, ep=2, cuda=True, deep_ep=True)
    check_dispatcher("alltoall", use_te=False, tp=1, ep=1, cuda=False, deep_ep=False)
    with pytest.raises(DispatcherError, match="parallel.dispatcher"):
        kernel_kwargs(use_te=False, mla=False, dispatcher="deepep")


def test_cpu_build_refuses_flex_in_one_line(tiny_model_dir):
    import json

    from parallel import specs
    from sao_megatron.core.dims import ParallelDims

    hf = json.loads((tiny_model_dir / "config.json").read_text())
    with pytest.raises(DispatcherError, match=r"^parallel.dispatcher = flex needs CUDA") as err:
        specs.transformer_config(hf, ParallelDims(ep=2), dispatcher="flex")
    assert "\n" not in str(err.value)
    cfg = specs.transformer_config(hf, ParallelDims())   # CPU: the local path, nothing fused
    assert not cfg.moe_grouped_gemm and not cfg.moe_permute_fusion and not cfg.apply_rope_fusion


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_replayed_topk_is_what_every_expert_kernel_consumes(score_function):
    from megatron.core.transformer.moe.moe_utils import permute, topk_routing_with_score_function
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    tokens, experts, k = 12, 8, 2
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(0))
    target = torch.stack([torch.randperm(experts, generator=torch.Generator().manual_seed(t))[:k]
                          for t in range(tokens)])
    replay = RouterReplay()
    try:
        replay.set_target_indices(target)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        probs, routing_map = topk_routing_with_score_function(logits, k, score_function=score_function,
                                                              fused=False, router_replay=replay)
    finally:
        RouterReplay.clear_global_router_replay_instances()
    wanted = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, target, True)
    assert torch.equal(routing_map, wanted)
    assert torch.equal(probs > 0, wanted)                  # probabilities live exactly at the replayed experts
    # the flex (DeepEP) dispatcher re-derives indices as topk(probs) (token_dispatcher.py:1161)
    flex_pick = torch.zeros_like(wanted).scatter_(1, torch.topk(probs, k, dim=-1).indices, True)
    assert torch.equal(flex_pick, wanted)
    # permutation (fused or not, same contract) groups tokens by routing_map: grouped GEMM's per-expert counts
    hidden = torch.randn(tokens, 4)
    permuted, _, _ = permute(hidden, routing_map)
    assert permuted.shape[0] == tokens * k


def test_kernels_downstream_of_the_router_read_only_probs_and_routing_map():
    """Source pins (Megatron-Core 0.16.1): if an upgrade moves replay out of the top-k or makes a kernel
    route by itself, this fails and parallel/fusions.py's argument must be redone."""
    from megatron.core.transformer.moe import moe_layer, moe_utils, token_dispatcher

    topk_src = inspect.getsource(moe_utils.topk_routing_with_score_function)
    assert "router_replay.get_replay_topk" in topk_src
    assert topk_src.index("if fused:") < topk_src.index("def compute_topk")   # fused top-k bypasses replay
    preprocess = inspect.getsource(moe_layer.MoELayer.preprocess)
    assert "dispatch_preprocess(" in preprocess and "routing_map" in preprocess
    alltoall = inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher.dispatch_preprocess)
    assert "routing_map" in alltoall and "fused=self.config.moe_permute_fusion" in alltoall
    flex = inspect.getsource(token_dispatcher.MoEFlexTokenDispatcher.dispatch_preprocess)
    assert "setup_metadata(routing_map, probs)" in flex
    deepep = inspect.getsource(token_dispatcher._DeepepManager.setup_metadata)
    assert "torch.topk(probs, self.router_topk" in deepep


def test_rl_model_refuses_flex_on_cpu_before_any_process_group():
    from sao_megatron.core.config import load_recipe

    if torch.cuda.is_available():
        pytest.skip("the refusal is for CPU-only machines")
    from parallel.rl_model import _refuse_gpu_only_options

    recipe = load_recipe(None, ["model.path=unused", "parallel.dispatcher=flex", "parallel.ep=2",
                                "parallel.world_size=2"], check_files=False)
    with pytest.raises(DispatcherError, match=r"^parallel.dispatcher = flex needs CUDA; fix:"):
        _refuse_gpu_only_options(recipe)
