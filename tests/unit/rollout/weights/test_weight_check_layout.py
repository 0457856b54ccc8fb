"""check_weight_update_equal against in-process engines that answer /weights_checker replies:
the transformers 5 fused-expert layout (checked against the reference server's own loader), the
SGLang layout (replicated tensors compared, homes for the rest), cross-engine and cross-rank agreement."""
from __future__ import annotations

import asyncio

import pytest
import torch

from rollout.engines.engine import EngineError
from rollout.weights.checksum import (checksum_reply, engine_checksum, overall_checksum, parse_weights_checker_reply,
                                     tensor_checksum, tensor_checksums)
from rollout.weights.check import (WeightMismatchError, check_weight_update_equal, engine_layout, fused_experts,
                                   sglang_homes)

P = "model.layers.0.mlp.experts"


def _hf(seed=0, experts=2, inter=3, hidden=4):
    g = torch.Generator().manual_seed(seed)
    named = [("model.norm.weight", torch.randn(hidden, generator=g)),
             ("model.layers.0.self_attn.q_proj.weight", torch.randn(hidden, hidden, generator=g)),
             ("model.layers.0.self_attn.k_proj.weight", torch.randn(2, hidden, generator=g)),
             ("model.layers.0.self_attn.v_proj.weight", torch.randn(2, hidden, generator=g)),
             ("model.layers.0.input_layernorm.weight", torch.randn(hidden, generator=g)),
             ("model.layers.0.mlp.gate.weight", torch.randn(experts, hidden, generator=g))]
    for e in range(experts):
        named += [(f"{P}.{e}.gate_proj.weight", torch.randn(inter, hidden, generator=g)),
                  (f"{P}.{e}.up_proj.weight", torch.randn(inter, hidden, generator=g)),
                  (f"{P}.{e}.down_proj.weight", torch.randn(hidden, inter, generator=g))]
    return named


def _fused(named):
    """The engine side built by the reference server's own loader (WeightMap), not by fused_experts."""
    from rollout.engines.reference_server.weights import WeightMap

    module = torch.nn.Module()
    params = {n: torch.nn.Parameter(t.clone()) for n, t in named if ".experts." not in n}
    e = sum(1 for n, _ in named if n.endswith("down_proj.weight"))
    inter, hidden = dict(named)[f"{P}.0.gate_proj.weight"].shape
    params[f"{P}.gate_up_proj"] = torch.nn.Parameter(torch.zeros(e, 2 * inter, hidden))
    params[f"{P}.down_proj"] = torch.nn.Parameter(torch.zeros(e, hidden, inter))
    for n, p in params.items():
        module.register_parameter(n.replace(".", "_"), p)
    wm = WeightMap(module)
    wm.params = params
    with torch.no_grad():
        for n, t in named:
            wm.load(n, t)
    return {n: p.data for n, p in params.items()}


class ChecksumEngine:
    """An engine whose /weights_checker reply is given (parsed as SGLangEngine parses it)."""

    def __init__(self, name, reply):
        self.name, self.reply = name, reply

    async def check_weights(self, action="checksum", skip_tensor_list=None, selector="all"):
        assert selector == "target"   # the trainer never checks draft models
        return parse_weights_checker_reply(self.reply)


def _engine(name, per_rank):
    return ChecksumEngine(name, checksum_reply(per_rank))


def _check(engines, named, **kw):
    return asyncio.run(check_weight_update_equal(engines, iter(named), **kw))


def test_fused_experts_match_the_reference_servers_loader():
    named = _hf()
    built = dict(fused_experts({P: {e: {p: t for n, t in named if n.startswith(f"{P}.{e}.")
                                        for p in [n.split(".")[-2]]} for e in range(2)}}))
    served = _fused(named)
    assert torch.equal(built[f"{P}.gate_up_proj"], served[f"{P}.gate_up_proj"])
    assert torch.equal(built[f"{P}.down_proj"], served[f"{P}.down_proj"])
    with pytest.raises(ValueError, match=r"lacks gate/up/down tensors of expert 0"):
        list(fused_experts({P: {1: {"gate_proj": torch.zeros(1)}}}))


def test_hf_layout_passes_on_equal_weights_and_names_the_differing_fused_tensor():
    named = _hf()
    served = _fused(named)
    sums = {n: tensor_checksum(t) for n, t in served.items()}
    [result] = _check([_engine("ref", [sums])], named)
    assert (result.layout, result.compared, result.unverified, result.ranks) == ("hf", len(served), 0, 1)
    bad = dict(sums, **{f"{P}.down_proj": tensor_checksum(served[f"{P}.down_proj"] + 1)})
    with pytest.raises(WeightMismatchError, match=rf"engine ref \(tp_rank 0 of 1\): {P}.down_proj differs"):
        _check([_engine("ref", [bad])], named)


def test_hf_layout_names_must_match_both_ways_except_tied_tensors():
    named = _hf()
    sums = {n: tensor_checksum(t) for n, t in _fused(named).items()}
    missing = {n: s for n, s in sums.items() if n != "model.norm.weight"}
    with pytest.raises(WeightMismatchError, match=r"trainer tensor model.norm.weight is missing"):
        _check([_engine("ref", [missing])], named)
    with pytest.raises(WeightMismatchError, match=r"tensor model.extra.weight is not among the trainer's"):
        _check([_engine("ref", [dict(sums, **{"model.extra.weight": "00"})])], named)
    tied = named + [("lm_head.weight", dict(named)["model.norm.weight"].clone())]   # same bytes: tied
    assert _check([_engine("ref", [sums])], tied)[0].compared == len(sums)


def test_hf_layout_per_expert_names_dtype_and_gpu_hash_kind():
    named = _hf()
    cast = {n: t.to(torch.bfloat16) for n, t in named}
    gpu = {n: tensor_checksums(t)["gpu"] for n, t in cast.items()}     # an engine hashing on CUDA
    [result] = _check([_engine("loop", [gpu])], named, dtype=torch.bfloat16)
    assert result.compared == len(named)
    with pytest.raises(WeightMismatchError, match="differs from the trainer"):
        _check([_engine("loop", [gpu])], named)       # the trainer's fp32 bytes are not the engine's bf16


def _sglang_ranks(named, tp=2, dtype=torch.bfloat16, router_fp32=True):
    """What a TP-2 SGLang engine reports: replicated tensors whole (router in float32 as GLM keeps it),
    fused and sharded ones under SGLang's names (their hashes cannot be predicted by the trainer)."""
    d = dict(named)
    ranks = []
    for r in range(tp):
        sums = {"model.norm.weight": tensor_checksums(d["model.norm.weight"].to(dtype))["gpu"],
                "model.layers.0.input_layernorm.weight":
                    tensor_checksums(d["model.layers.0.input_layernorm.weight"].to(dtype))["gpu"],
                "model.layers.0.mlp.gate.weight": tensor_checksums(
                    d["model.layers.0.mlp.gate.weight"].to(torch.float32 if router_fp32 else dtype))["gpu"],
                "model.layers.0.self_attn.qkv_proj.weight": f"{r:016x}",
                f"{P}.w13_weight": f"{10 + r:016x}", f"{P}.w2_weight": f"{20 + r:016x}"}
        ranks.append(sums)
    reply = checksum_reply(ranks)
    for r, rank in enumerate(reply["ranks"]):
        rank["parallelism_info"][0].update(tp_rank=r, tp_size=tp, rank=r, size=tp)
    return reply


def test_sglang_layout_compares_replicated_tensors_on_every_rank_and_counts_the_rest():
    named = _hf()
    reply = _sglang_ranks(named)
    assert engine_layout(parse_weights_checker_reply(reply)) == "sglang"
    [result] = _check([ChecksumEngine("sg", reply)], named)
    assert (result.layout, result.ranks, result.compared, result.unverified) == ("sglang", 2, 6, 6)
    moved = [(n, t + 1 if n == "model.layers.0.input_layernorm.weight" else t) for n, t in named]
    with pytest.raises(WeightMismatchError,
                       match=r"engine sg \(tp_rank 0 of 2\): model.layers.0.input_layernorm.weight differs"):
        _check([ChecksumEngine("sg", reply)], moved)


def test_sglang_layout_needs_a_home_for_every_trainer_tensor():
    named = _hf()
    reply = _sglang_ranks(named)
    for rank in reply["ranks"]:
        del rank["checksums"][f"{P}.w2_weight"]
        rank["per_gpu_checksum"] = overall_checksum(rank["checksums"])
    reply["per_engine_checksum"] = engine_checksum(r["per_gpu_checksum"] for r in reply["ranks"])
    with pytest.raises(WeightMismatchError, match=rf"trainer tensor {P}.0.down_proj.weight has no home .*w2_weight"):
        _check([ChecksumEngine("sg", reply)], named)


def test_engines_of_one_layout_must_agree_rank_by_rank():
    named = _hf()
    good, odd = _sglang_ranks(named), _sglang_ranks(named)
    odd["ranks"][1]["checksums"][f"{P}.w13_weight"] = "ffffffffffffffff"
    odd["ranks"][1]["per_gpu_checksum"] = overall_checksum(odd["ranks"][1]["checksums"])
    odd["per_engine_checksum"] = engine_checksum(r["per_gpu_checksum"] for r in odd["ranks"])
    assert len(_check([ChecksumEngine("a", good), ChecksumEngine("b", good)], named)) == 2
    with pytest.raises(WeightMismatchError, match=rf"engine b \(tp_rank 1 of 2\): {P}.w13_weight differs from"):
        _check([ChecksumEngine("a", good), ChecksumEngine("b", odd)], named)


def test_tp_ranks_of_a_stage_must_hash_the_same_names():
    named = _hf()
    reply = _sglang_ranks(named)
    reply["ranks"][1]["checksums"]["model.layers.0.extra"] = "00"
    reply["ranks"][1]["per_gpu_checksum"] = overall_checksum(reply["ranks"][1]["checksums"])
    reply["per_engine_checksum"] = engine_checksum(r["per_gpu_checksum"] for r in reply["ranks"])
    with pytest.raises(WeightMismatchError, match=r"tp_rank 1 of 2\): hashed a different set .*model.layers.0.extra"):
        _check([ChecksumEngine("sg", reply)], named)


def test_no_engines_still_drains_the_export_and_an_empty_reply_is_an_engine_error():
    seen = []
    assert _check([], ((seen.append(n), (n, t))[1] for n, t in _hf())) == [] and len(seen) == len(_hf())
    with pytest.raises(EngineError, match=r"engine e: /weights_checker answered without per-rank checksums"):
        _check([ChecksumEngine("e", {"success": True, "message": "Success."})], _hf())


def test_sglang_homes_follow_its_stacked_and_expert_mappings():
    assert sglang_homes("model.layers.1.self_attn.k_proj.bias") == ("model.layers.1.self_attn.k_proj.bias",
                                                                    "model.layers.1.self_attn.qkv_proj.bias")
    assert sglang_homes(f"{P}.7.up_proj.weight") == (f"{P}.w13_weight",)
    assert "model.layers.0.mlp.gate_up_proj.weight" in sglang_homes("model.layers.0.mlp.gate_proj.weight")
    assert f"{P}.w2_weight" in sglang_homes("model.layers.0.mlp.shared_experts.down_proj.weight")
    assert sglang_homes("lm_head.weight") == ("lm_head.weight", "model.embed_tokens.weight")


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_served_transformers5_model_matches_its_hf_checkpoint(arch, tmp_path):
    """The reference server's checksum map of a freshly loaded model (GLM-4.5: dense first layer, shared
    experts, the router bias as a buffer) equals the trainer's checksums of the same HF tensors."""
    import transformers

    from checkpoints.hf_io import HFCheckpoint
    from checkpoints.init_model import init_model
    from rollout.engines.reference_server.weights_checker import model_checksums

    model_dir = init_model(tmp_path / arch, arch=arch, preset="tiny", seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sums = model_checksums(model)
    named = list(HFCheckpoint(model_dir).items())
    [result] = _check([_engine("ref", [sums])], named)
    assert result.compared == len(sums) and not any("inv_freq" in n for n in sums)
    if arch == "glm4_moe":
        assert {"model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.0.mlp.gate_proj.weight"} <= set(sums)
