"""HF -> Megatron shards -> HF is bit-exact for every tensor, every rank, every layout (pure torch)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from checkpoints.arch import spec_from_hf_dir
from checkpoints.convert import hf_to_mcore, mcore_to_hf, shard_all
from checkpoints.hf_io import HFCheckpoint, save_hf_checkpoint
from checkpoints.layout import ShardLayout, all_layouts
from checkpoints.name_map import canonical_mcore_name, expected_hf_names
from checkpoints.tensor_layouts import pack_qkv
from checkpoints.tiny_models import make_tiny_hf

LAYOUTS = {"TP1": {}, "TP2": dict(tp=2), "EP2": dict(ep=2), "PP2": dict(pp=2), "TP2xEP2": dict(tp=2, ep=2),
           "PP2xVPP2": dict(pp=2, vpp=2), "TP2xEP2xPP2": dict(tp=2, ep=2, pp=2), "EP4xETP1xTP2": dict(tp=2, ep=4, etp_size=1),
           "PP2last1": dict(pp=2, last_stage_layers=1), "PP2last3": dict(pp=2, last_stage_layers=3)}


@pytest.fixture(scope="module")
def glm_model_dir(tmp_path_factory):
    """GLM-4.5-style: 1 dense layer, shared expert, qkv bias, qk norm, expert bias."""
    return make_tiny_hf(tmp_path_factory.mktemp("glm") / "model", "glm4_moe", seed=1)


@pytest.fixture(scope="module")
def glm5_model_dir(tmp_path_factory):
    """GLM-5-class: MLA with q LoRA, 1 dense layer, shared expert, DSA indexer."""
    return make_tiny_hf(tmp_path_factory.mktemp("glm5") / "model", "glm5", seed=2)


@pytest.fixture(scope="module")
def deepseek_v3_model_dir(tmp_path_factory):
    """DeepSeek-V3: MLA without the q LoRA (one q_proj), group-limited routing, no indexer."""
    return make_tiny_hf(tmp_path_factory.mktemp("dsv3") / "model", "deepseek_v3", seed=4, preset="tiny-no-q-lora")


def _model(request, which):
    return request.getfixturevalue({"qwen3_moe": "tiny_model_dir", "glm4_moe": "glm_model_dir",
                                    "glm5": "glm5_model_dir", "deepseek_v3": "deepseek_v3_model_dir"}[which])


@pytest.mark.parametrize("which", ["qwen3_moe", "glm4_moe", "glm5", "deepseek_v3"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_round_trip_bit_exact(request, which, name):
    path = _model(request, which)
    spec = spec_from_hf_dir(path)
    hf = dict(HFCheckpoint(path))
    # the map covers every on-disk tensor, GLM-5's DSA indexers included
    assert expected_hf_names(spec) == set(hf)
    assert (which == "glm5") == any(".self_attn.indexer." in n for n in hf)
    shards = shard_all(hf, spec, all_layouts(**LAYOUTS[name]))
    back = mcore_to_hf(shards, spec)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def _te_name(name: str) -> str:
    """What a Transformer Engine layer spec calls a local-spec tensor (fused norms, grouped experts)."""
    for local, te in [("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                      ("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"),
                      ("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight")]:
        if name.endswith(local) and "layers." in name:
            return name.replace(local, te)
    if ".mlp.experts.local_experts." in name:
        prefix, rest = name.split(".mlp.experts.local_experts.")
        j, fc, _ = rest.split(".")
        return f"{prefix}.mlp.experts.{fc}.weight{j}"
    return name


def test_canonical_names_read_transformer_engine_specs():
    assert canonical_mcore_name("decoder.layers.3.mlp.experts.linear_fc1.weight7") == \
        "decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"
    assert canonical_mcore_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == "decoder.layers.0.pre_mlp_layernorm.weight"
    assert canonical_mcore_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.0.input_layernorm.weight"
    assert canonical_mcore_name("decoder.layers.0.self_attention.linear_qkv.weight") == \
        "decoder.layers.0.self_attention.linear_qkv.weight"


@pytest.mark.parametrize("which", ["qwen3_moe", "glm5"])
def test_transformer_engine_named_shards_export_to_the_same_hf(request, which):
    path = _model(request, which)
    spec = spec_from_hf_dir(path)
    hf = {k: v for k, v in HFCheckpoint(path).items() if k in expected_hf_names(spec)}
    shards = shard_all(hf, spec, all_layouts(tp=2, ep=2))
    te_shards = {layout: [{_te_name(k): t for k, t in chunk.items()} for chunk in chunks] for layout, chunks in shards.items()}
    assert any(".experts.linear_fc1.weight" in k for chunks in te_shards.values() for k in chunks[0])
    back = mcore_to_hf(te_shards, spec)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_glm5_mla_names_and_tp_split(glm5_model_dir):
    spec, hf = spec_from_hf_dir(glm5_model_dir), HFCheckpoint(glm5_model_dir)
    assert spec.mla and spec.q_lora_rank == 32 and spec.moe_layers == frozenset({1, 2, 3})
    sd = hf_to_mcore(hf, spec, ShardLayout(tp_size=2, tp_rank=1))[0]
    a, h = "decoder.layers.1.self_attention.", "model.layers.1.self_attn."
    assert torch.equal(sd[a + "linear_kv_up_proj.weight"], hf[h + "kv_b_proj.weight"][64:])   # heads 2, 3
    assert torch.equal(sd[a + "linear_q_down_proj.weight"], hf[h + "q_a_proj.weight"][16:])
    assert torch.equal(sd[a + "kv_layernorm.weight"], hf[h + "kv_a_layernorm.weight"])
    assert torch.equal(sd[a + "linear_proj.weight"], hf[h + "o_proj.weight"][:, 32:])


def test_glm_spec_reads_optional_parts(glm_model_dir):
    spec = spec_from_hf_dir(glm_model_dir)
    assert (spec.qkv_bias, spec.qk_norm, spec.shared_experts, spec.expert_bias) == (True, True, True, True)
    assert spec.moe_layers == frozenset({1, 2, 3})
    sd = hf_to_mcore(HFCheckpoint(glm_model_dir), spec, ShardLayout())[0]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in sd and "decoder.layers.0.mlp.router.weight" not in sd
    hf = HFCheckpoint(glm_model_dir)
    assert torch.equal(sd["decoder.layers.2.mlp.router.expert_bias"], hf["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert sd["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"].shape == (64, 64)  # [gate; up], 32 rows each


def test_ep_rank_holds_global_experts_by_offset(tiny_model_dir):
    """EP rank e, local expert j = global expert e*E/EP + j (a wrong order is silent in shapes)."""
    spec, hf = spec_from_hf_dir(tiny_model_dir), HFCheckpoint(tiny_model_dir)
    sd = hf_to_mcore(hf, spec, ShardLayout(ep_size=4, ep_rank=3))[0]
    got = sd["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert torch.equal(got, hf["model.layers.1.mlp.experts.7.down_proj.weight"])
    assert sum(".local_experts." in k for k in sd) == 4 * 2 * 2  # 4 layers x 2 local experts x fc1/fc2


def test_tp_shards_group_qkv_and_glu(tiny_model_dir):
    """TP rank 1 holds KV group 1 = [q heads 2,3; k head 1; v head 1] and [gate_1; up_1] of fc1."""
    spec, hf = spec_from_hf_dir(tiny_model_dir), HFCheckpoint(tiny_model_dir)
    sd = hf_to_mcore(hf, spec, ShardLayout(tp_size=2, tp_rank=1))[0]
    p = "model.layers.0."
    d = spec.head_dim
    expect_qkv = torch.cat([hf[p + "self_attn.q_proj.weight"][2 * d:], hf[p + "self_attn.k_proj.weight"][d:],
                            hf[p + "self_attn.v_proj.weight"][d:]])
    assert torch.equal(sd["decoder.layers.0.self_attention.linear_qkv.weight"], expect_qkv)
    gate, up = hf[p + "mlp.experts.0.gate_proj.weight"], hf[p + "mlp.experts.0.up_proj.weight"]
    assert torch.equal(sd["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"], torch.cat([gate[32:], up[32:]]))
    assert torch.equal(sd["decoder.layers.0.self_attention.linear_proj.weight"], hf[p + "self_attn.o_proj.weight"][:, 64:])
    # vocab 105 padded to 106: rank 1 holds rows 53..104 and one zero row
    emb = sd["embedding.word_embeddings.weight"]
    assert emb.shape == (53, 64) and torch.equal(emb[:52], hf["model.embed_tokens.weight"][53:]) and not emb[52].any()


def test_pp_vpp_layer_placement(tiny_model_dir):
    """PP2 x VPP2 over 4 layers: rank 0 holds global layers 0 and 2, rank 1 holds 1 and 3 (Megatron offsets)."""
    spec, hf = spec_from_hf_dir(tiny_model_dir), HFCheckpoint(tiny_model_dir)
    chunks = hf_to_mcore(hf, spec, ShardLayout(pp_size=2, pp_rank=1, vpp_size=2))
    key = "decoder.layers.0.input_layernorm.weight"
    assert torch.equal(chunks[0][key], hf["model.layers.1.input_layernorm.weight"])
    assert torch.equal(chunks[1][key], hf["model.layers.3.input_layernorm.weight"])
    assert "output_layer.weight" in chunks[1] and "output_layer.weight" not in chunks[0]
    assert all("embedding" not in k for c in chunks for k in c)


def test_tied_embeddings_output_layer_only_on_later_stage(tiny_model_dir):
    spec = dataclasses.replace(spec_from_hf_dir(tiny_model_dir), tie_embeddings=True)
    hf = {k: v for k, v in HFCheckpoint(tiny_model_dir).items() if k != "lm_head.weight"}
    assert "output_layer.weight" not in hf_to_mcore(hf, spec, ShardLayout())[0]
    last = hf_to_mcore(hf, spec, ShardLayout(pp_size=2, pp_rank=1))[0]
    assert torch.equal(last["output_layer.weight"][:105], hf["model.embed_tokens.weight"])
    back = mcore_to_hf(shard_all(hf, spec, all_layouts(pp=2)), spec)
    assert set(back) == set(hf)


def test_critic_load_leaves_out_the_output_layer(tiny_model_dir):
    spec, hf = spec_from_hf_dir(tiny_model_dir), HFCheckpoint(tiny_model_dir)
    policy = hf_to_mcore(hf, spec, ShardLayout())[0]
    critic = hf_to_mcore(hf, spec, ShardLayout(), with_output=False)[0]
    assert set(policy) - set(critic) == {"output_layer.weight"}


def test_missing_shard_and_missing_tensor_named(tiny_model_dir):
    spec, hf = spec_from_hf_dir(tiny_model_dir), dict(HFCheckpoint(tiny_model_dir))
    shards = shard_all(hf, spec, all_layouts(tp=2))
    shards.pop(ShardLayout(tp_size=2, tp_rank=1))
    with pytest.raises(KeyError, match="tp_rank=1"):
        mcore_to_hf(shards, spec)
    hf.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    with pytest.raises(KeyError, match="experts.5.up_proj"):
        hf_to_mcore(hf, spec, ShardLayout())


def test_bad_layouts_are_refused(tiny_model_dir):
    spec, hf = spec_from_hf_dir(tiny_model_dir), HFCheckpoint(tiny_model_dir)
    with pytest.raises(ValueError, match="pp=3"):
        hf_to_mcore(hf, spec, ShardLayout(pp_size=3))
    with pytest.raises(ValueError, match="ep=3"):
        hf_to_mcore(hf, spec, ShardLayout(ep_size=3))
    with pytest.raises(ValueError, match="tp_rank 2"):
        ShardLayout(tp_size=2, tp_rank=2)


def test_pack_qkv_matches_head_grouping():
    """4 query heads, 2 KV groups, head_dim 1: [q0 q1 k0 v0 | q2 q3 k1 v1]."""
    q, k, v = torch.tensor([[0], [1], [2], [3]]), torch.tensor([[10], [11]]), torch.tensor([[20], [21]])
    assert pack_qkv(q, k, v, num_kv_heads=2).flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_save_hf_checkpoint_shards_and_reloads(tiny_model_dir, tmp_path):
    hf = HFCheckpoint(tiny_model_dir)
    out = save_hf_checkpoint(tmp_path / "out", hf.items(), aux_from=tiny_model_dir, max_shard_mb=0.2)
    back = HFCheckpoint(out)
    assert len({back.weight_map[k] for k in back}) > 1 and (out / "config.json").is_file()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
