"""GLM-4.5-MoE (dense first layer, shared expert, sigmoid router with correction bias, QKV bias,
partial RoPE) against HF transformers' Glm4MoeForCausalLM on a random tiny model under DP2 (whole
model per rank), TP2, EP2 and PP2: logprobs within 2e-6, HF export bit-exact."""
from __future__ import annotations

import pytest
import torch

from parallel.distributed import run_distributed_test

# dp2 holds the whole model on each rank: the single-rank (tiny demo) layout.
LAYOUTS = {"dp2": dict(), "tp2": dict(tp=2), "ep2": dict(ep=2), "pp2": dict(pp=2)}


@pytest.fixture(scope="module")
def tiny_glm_dir(tmp_path_factory):
    import transformers

    out = tmp_path_factory.mktemp("glm45") / "model"
    cfg = transformers.Glm4MoeConfig(
        vocab_size=120, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1, topk_group=1,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True, max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:  # non-zero so a dropped bias changes the routing
                buf.copy_(torch.randn_like(buf) * 0.1)
    model.save_pretrained(out)
    return out


def _glm_layouts(model_dir: str, layouts: dict) -> dict:
    import transformers
    from safetensors.torch import load_file

    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    hf = load_file(f"{model_dir}/model.safetensors")
    batch = lc.fixed_batches(120, num=1, seq=12)[0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(batch.tokens).logits
    ref = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    out = {}
    for name, layout in layouts.items():
        teardown_model_parallel()
        model = RLModel.build(lc.make_recipe(model_dir, layout), "policy")
        model.load_hf_state_dict(hf)
        logp = model.compute_logprobs([batch])[0][0]
        exported = dict(model.export_hf())
        out[name] = {"logp_delta": float((logp[:, 1:] - ref).abs().max()),
                     "export_exact": set(exported) == set(hf) and all(torch.equal(exported[k], hf[k]) for k in hf)}
    teardown_model_parallel()
    return out


def test_glm45_two_rank_layouts_match_hf(tiny_glm_dir):
    ranks = run_distributed_test(_glm_layouts, world_size=2, timeout_s=600, args=(str(tiny_glm_dir), LAYOUTS))
    for rank in ranks:
        for name in LAYOUTS:
            assert rank[name]["logp_delta"] < 2e-6, (name, rank[name])
            assert rank[name]["export_exact"], name
