"""`sao plan` counts DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): indexer parameters of the layers that run
their own indexer, attention FLOPs at the top-k keys plus the indexer's scoring, and the engine's index-key cache.
Every expected number is worked out by hand from the small config below."""
from __future__ import annotations

import pytest

from parallel.model_shapes import all_layers, count_parameters, embedding_params
from parallel.planner import timing
from parallel.planner.engine import kv_bytes_per_token
from parallel.planner.timing import forward_flops_per_token, kv_read_bytes, mean_sparse_keys

# Layer 1 reuses layer 0's selection ("shared"); layer 0 is dense, layers 1-2 MoE; one MTP layer.
CFG = dict(model_type="glm_moe_dsa", num_hidden_layers=3, hidden_size=64, num_attention_heads=4, q_lora_rank=32,
           kv_lora_rank=128, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_topk=4, index_n_heads=2,
           index_head_dim=128, indexer_types=["full", "shared", "full"], first_k_dense_replace=1,
           intermediate_size=96, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
           n_shared_experts=1, scoring_func="sigmoid", vocab_size=100, num_nextn_predict_layers=1)
INDEXER = 32 * 2 * 128 + 64 * 128 + 64 * 2 + 2 * 128   # wq_b, wk, weights_proj, k_norm (w + b) = 16768


def test_indexer_parameters_only_where_a_layer_runs_its_own_indexer():
    assert [p.indexer for p in all_layers(CFG)] == [INDEXER, 0, INDEXER]
    assert [p.indexer for p in all_layers(CFG, include_mtp=True)][-1] == INDEXER   # SGLang's NextN layer has one
    dense = dict(CFG, index_topk=0, index_n_heads=0)
    assert count_parameters(CFG).total - count_parameters(dense).total == 2 * INDEXER
    assert count_parameters(CFG).active - count_parameters(dense).active == 2 * INDEXER


def test_mean_keys_a_query_attends_under_top_k():
    assert mean_sparse_keys(4, 4) == 2                       # short sequence: dense causal, s / 2
    assert mean_sparse_keys(10, 4) == pytest.approx(3.2)     # (4^2 / 2 + 4 * 6) / 10
    assert mean_sparse_keys(1e6, 2048) == pytest.approx(2048 - 2048 ** 2 / 2e6)


def test_forward_flops_attend_top_k_keys_and_add_the_indexer_scoring():
    params = 2 * (count_parameters(CFG).active - embedding_params(CFG))
    attention_per_key = 2 * 4 * (12 + 8)                     # heads x (q.k width + v width), multiply-add
    indexer = 2 * (2 * 2 * (128 + 1) * 5)                    # 2 indexer layers, 2 heads, q.k + weight, 10/2 keys
    sparse = params + attention_per_key * 3.2 * 3 + indexer  # 3 layers at mean_sparse_keys(10, 4)
    dense = params + attention_per_key * 5 * 3 + indexer
    assert forward_flops_per_token(CFG, 10) == pytest.approx(sparse)
    assert forward_flops_per_token(CFG, 10, sparse_attention=False) == pytest.approx(dense)
    assert forward_flops_per_token(CFG, 4) == forward_flops_per_token(CFG, 4, sparse_attention=False)


def test_train_time_counts_the_trainers_masked_dense_attention(monkeypatch):
    seen = []
    monkeypatch.setattr(timing, "forward_flops_per_token", lambda cfg, seq, **kw: seen.append(kw) or 1.0)
    from test_plan_time import _qwen_input

    from parallel.planner import make_plan
    timing.train_seconds(make_plan(_qwen_input()), timing.Workload(8, 100, 100, 200))
    assert seen == [{"sparse_attention": False}]


def test_engine_cache_holds_index_keys_of_indexer_layers_only():
    latent_bf16 = (128 + 4) * 2                              # kv_lora + rope, bf16
    latent_fp8 = 128 + 128 // 128 * 4 + 4 * 2                # fp8 latent, fp32 scale per 128, bf16 rope
    index = 2 * (128 + 4)                                    # 2 indexer layers: fp8 key + fp32 scale
    assert kv_bytes_per_token(CFG, 1, 2) == 3 * latent_bf16 + index == 1056
    assert kv_bytes_per_token(CFG, 1, 1) == 3 * latent_fp8 + index == 684
    # decode scores the index keys of all 10 tokens and reads latents of its top 4
    assert kv_read_bytes(CFG, 10, 1, 2) == index * 10 + 3 * latent_bf16 * 4 == 5808


def test_plan_of_a_dsa_recipe_uses_the_launchers_dp_attention(tmp_path):
    """engine_dp_attention 0 on a DSA model: the launcher runs DP attention across the engine, so does the plan."""
    from parallel.planner.from_recipe import plan_input_from_recipe
    from sao_megatron.core.config.recipe import load_recipe

    path = tmp_path / "r.toml"
    for preset, expected in (("glm5-744b-a40b", 8), ("deepseek-v3", 0)):
        path.write_text(f'[model]\npath = "/nowhere"\nshape_preset = "{preset}"\n'
                        '[rollout]\nengine = "sglang"\nengine_tp = 8\nengine_ep = 8\n')
        assert plan_input_from_recipe(load_recipe(path, [], check_files=False)).engine.dp_attention == expected


def test_dsa_layers_keep_dense_scores_on_transformer_engine_too():
    """TE has no sparse attention: DSA layers run our masked attention, fp32 + bf16 probabilities of every key
    (3 bf16 elements each, 4 heads on tp 1) plus a one-byte mask per key: 3 * 4 * 10 + 10 / 2 per token."""
    from parallel.planner import Layout
    from parallel.planner.activations import activation_bytes, layer_activation_elems

    dense = dict(CFG, index_topk=0)
    for recompute, extra in (("none", 125), ("selective", 0), ("full", 0)):
        diff = (layer_activation_elems(CFG, True, Layout(), recompute, "te", 10)
                - layer_activation_elems(dense, True, Layout(), recompute, "te", 10))
        assert diff == extra
    # full recompute rebuilds one layer at a time during backward: its scores once, 10 tokens x 2 bytes
    full = activation_bytes(CFG, Layout(), 0, 10, "full", 2, value_head=True, seq_len=10)
    assert full - activation_bytes(dense, Layout(), 0, 10, "full", 2, value_head=True, seq_len=10) == 125 * 10 * 2


def test_plan_on_b200_says_fp8_engines_are_refused():
    from dataclasses import replace

    from test_plan_time import _qwen_input

    from parallel.planner import GPUS, make_plan
    from parallel.planner.engine import EngineOptions

    fp8 = replace(_qwen_input(), engine=EngineOptions(tp=4, ep=4, fp8_weights=True))
    assert any("FP8 engines on b200 are refused" in n for n in make_plan(replace(fp8, gpu=GPUS["b200"])).notes)
    assert not any("FP8 engines" in n for n in make_plan(fp8).notes)   # h100
