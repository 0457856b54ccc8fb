"""Packed micro-batches (parallel.pack_sequences) give the padded path's numerics.

Same weights, same micro-batches (ragged lengths, random engine routes to replay), once right-padded
and once with `packed` set (one row; THD with per-sample attention, parallel/packed_attention.py, on the
local spec): logprobs, critic values and routing maps at every real position, the loss and grad norm of a
first step and the loss of a second (so the optimizer step itself agrees), on one rank and under TP2 and
PP2. Measured on one rank: logprobs within 4.8e-7, losses and grad norms equal. MLA (tiny GLM-5 with DSA)
runs packed rows under a block-diagonal mask with positions start_r.. (RoPE is relative: equal up to
rounding), hence its wider tolerance.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel import layout_check as lc
from parallel.distributed import run_distributed_test

LOGP_TOL, LOSS_TOL, GRAD_REL_TOL = 2e-6, 1e-6, 1e-5
DSA_LOGP_TOL = 2e-5   # MLA on the local spec runs packed rows under a block-diagonal mask, positions not restarting


def _real(t: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Values at real positions only (padding positions are not results in either layout)."""
    return t[torch.arange(t.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)]


def _batches(model_dir: str):
    from parallel.model_build import read_hf_config
    from parallel.specs import arch_shape

    shape = arch_shape(read_hf_config(model_dir))
    padded = lc.fixed_batches(shape.vocab_size, num=2, rows=3, seq=16, num_layers=shape.num_layers,
                              top_k=shape.top_k, num_experts=shape.num_experts)
    # as the trainer lays routes out (batching._per_position): none from the last token on
    no_route = [torch.arange(16).unsqueeze(0) >= b.lengths.unsqueeze(1) - 1 for b in padded]
    padded = [replace(b, routed_experts=b.routed_experts.masked_fill(m[..., None, None], -1))
              for b, m in zip(padded, no_route)]
    return padded, [replace(b, packed=True) for b in padded]


def _layouts(model_dir: str, layouts: list[dict]) -> list[dict]:
    from safetensors.torch import load_file

    hf = load_file(f"{model_dir}/model.safetensors")
    padded, packed = _batches(model_dir)
    out = []
    for layout in layouts:
        a = lc.run_layout(model_dir, layout, hf, padded, steps=2)
        b = lc.run_layout(model_dir, layout, hf, packed, steps=2)
        out.append({"padded": a, "packed": b, "lengths": [x.lengths for x in padded]})
    return out


def _single(model_dir: str) -> dict:
    """One rank: the layouts' check plus routing maps (router hooks) and critic values."""
    from safetensors.torch import load_file

    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel
    from parallel.routing_replay import routers_of

    result = {"steps": _layouts(model_dir, [{}])[0]}
    hf = load_file(f"{model_dir}/model.safetensors")
    padded, packed = _batches(model_dir)
    teardown_model_parallel()
    policy = RLModel.build(lc.make_recipe(model_dir, {}), "policy")
    policy.load_hf_state_dict(hf)
    maps: list[torch.Tensor] = []
    for _, router in routers_of(policy.modules[0]):
        router.register_forward_hook(lambda mod, args, out: maps.append(out[1].detach().clone()))
    policy.compute_logprobs(padded[:1])
    result["maps_padded"], maps[:] = list(maps), []
    policy.compute_logprobs(packed[:1])
    result["maps_packed"] = list(maps)
    critic = RLModel.build(lc.make_recipe(model_dir, {}), "critic")
    critic.load_hf_state_dict(hf)
    with torch.no_grad():   # the value head starts at zero: give it weights so values say something
        for name, param in critic.modules[0].named_parameters():
            if name.startswith("output_layer"):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
    result["values"] = (critic.compute_values(padded), critic.compute_values(packed))
    teardown_model_parallel()
    return result


def _check_steps(out: dict) -> None:
    padded, packed, lengths = out["padded"], out["packed"], out["lengths"]
    for a, b, n in zip(padded["first"], packed["first"], lengths):
        assert float((_real(a, n) - _real(b, n)).abs().max()) < LOGP_TOL
    for a, b in zip(padded["steps"], packed["steps"]):   # step 2's loss follows one optimizer step
        assert abs(a["loss"] - b["loss"]) < LOSS_TOL
        assert abs(a["grad_norm"] - b["grad_norm"]) <= GRAD_REL_TOL * a["grad_norm"]
        assert a["route_agreement"] == pytest.approx(b["route_agreement"], abs=1e-9)


@pytest.fixture(scope="module")
def single(tiny_model_dir):
    return run_distributed_test(_single, world_size=1, timeout_s=300, args=(str(tiny_model_dir),))[0]


def test_packed_equals_padded_on_one_rank(single):
    _check_steps(single["steps"])


def test_packed_routes_are_the_padded_routes_in_packed_order(single):
    lengths = single["steps"]["lengths"][0]      # the one micro-batch the hooks saw
    for padded_map, packed_map in zip(single["maps_padded"], single["maps_packed"]):
        rows, seq = len(lengths), padded_map.shape[0] // len(lengths)
        by_row = padded_map.view(seq, rows, -1).transpose(0, 1)        # Megatron's [s, b] token order
        expected = torch.cat([by_row[r, :int(n)] for r, n in enumerate(lengths)])
        assert torch.equal(packed_map[:len(expected)], expected)


def test_packed_critic_values_equal_padded(single):
    padded, packed = single["values"]
    lengths = single["steps"]["lengths"]
    for a, b, n in zip(padded, packed, lengths):
        scale = float(_real(a, n).abs().max())
        assert scale > 1e-3      # the values are not trivially zero
        assert float((_real(a, n) - _real(b, n)).abs().max()) < 1e-6 * scale


def test_packed_equals_padded_under_tp2_and_pp2(tiny_model_dir):
    outs = run_distributed_test(_layouts, world_size=2, timeout_s=600,
                                args=(str(tiny_model_dir), [{"tp": 2}, {"pp": 2}]))[0]
    for out in outs:
        _check_steps(out)


def _dsa(model_dir: str) -> dict:
    """GLM-5 class (MLA + DSA, index_topk 4 < the sequence): padded vs packed logprobs and one step, with the
    trainer's own indexer (which must not select another sample's keys) and with a replayed selection (whose
    key positions move by each sample's start in the packed row)."""
    from safetensors.torch import load_file

    from parallel import dsa_check
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    hf = load_file(f"{model_dir}/model.safetensors")
    teardown_model_parallel()
    model = RLModel.build(lc.make_recipe(model_dir, {}), "policy")
    model.load_hf_state_dict(hf)
    batch = lc.fixed_batches(model.shape.vocab_size, num=1, rows=3, seq=12)[0]
    selection = dsa_check.random_selection(3, 12, ["full", "full", "shared", "full"], topk=4, seed=7)
    out = {"lengths": batch.lengths}
    for name, b in (("own", batch), ("replayed", dsa_check.with_selection(batch, selection))):
        out[name] = [model.compute_logprobs([x])[0][0] for x in (b, replace(b, packed=True))]
    teardown_model_parallel()
    return out


def test_packed_equals_padded_for_dsa(tmp_path):
    from checkpoints.tiny_models import FIXTURE, build_tiny_model
    from parallel.dsa_check import engine_norms

    model = build_tiny_model("glm5", 5, "tiny", **FIXTURE)
    engine_norms(model)
    model.save_pretrained(tmp_path / "model")
    out = run_distributed_test(_dsa, world_size=1, timeout_s=300, args=(str(tmp_path / "model"),))[0]
    for name in ("own", "replayed"):
        padded, packed = out[name]
        assert float((_real(padded, out["lengths"]) - _real(packed, out["lengths"])).abs().max()) < DSA_LOGP_TOL
