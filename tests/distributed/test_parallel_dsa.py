"""GLM-5 class (MLA + DSA with a shared indexer layer, index_topk 4 < the sequence) under DP2 (the whole
model per rank), TP2 (sequence parallel: the indexer gathers the sequence), EP2, PP2 (the shared layer 2
sits on the second stage, apart from its full layer 1, so it runs on the replayed selection), PP2 x VPP2
(one layer per virtual stage; Megatron's filler micro-batch keeps the selections) and PP2 with an uneven
last stage (3 + 1 layers):
with the engine's selection replayed, logprobs equal transformers forced to that selection within 2e-6
on every layout, one training step gives the same loss, gradient norm and indexer agreement as DP2,
and the HF export is bit-exact, indexers included."""
from __future__ import annotations

import pytest
import torch

from parallel.distributed import run_distributed_test

LAYOUTS = {"dp2": dict(), "tp2": dict(tp=2), "ep2": dict(ep=2), "pp2": dict(pp=2),
           "pp2vpp2": dict(pp=2, vpp=2), "pp2last1": dict(pp=2, last_stage_layers=1)}
SEQ = 12


@pytest.fixture(scope="module")
def tiny_glm5_dir(tmp_path_factory):
    from checkpoints.tiny_models import FIXTURE, build_tiny_model
    from parallel.dsa_check import engine_norms

    model = build_tiny_model("glm5", 5, "tiny", **FIXTURE)
    engine_norms(model)
    out = tmp_path_factory.mktemp("glm5") / "model"
    model.save_pretrained(out)
    return out


def _dsa_layouts(model_dir: str, layouts: dict) -> dict:
    import transformers
    from safetensors.torch import load_file

    from parallel import dsa_check
    from parallel import layout_check as lc
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel

    hf = load_file(f"{model_dir}/model.safetensors")
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    dsa_check.engine_norms(reference)
    batch = lc.fixed_batches(reference.config.vocab_size, num=1, seq=SEQ)[0]
    kinds = ["full", "full", "shared", "full"]
    selection = dsa_check.random_selection(batch.tokens.shape[0], SEQ, kinds, topk=4, seed=7)
    with dsa_check.force_selection(reference, selection):
        engine = dsa_check.hf_token_logprobs(reference, batch.tokens)
    replayed = dsa_check.with_selection(batch, selection)
    out = {}
    for name, layout in layouts.items():
        teardown_model_parallel()
        model = RLModel.build(lc.make_recipe(model_dir, layout), "policy")
        model.load_hf_state_dict(hf)
        logp = model.compute_logprobs([replayed])[0][0]
        exported = dict(model.export_hf())
        metrics = model.train_step([replayed], lc.policy_gradient_loss)
        out[name] = {"logp_delta": float((logp[:, 1:] - engine).abs().max()),
                     "export_exact": set(exported) == set(hf) and all(torch.equal(exported[k], hf[k]) for k in hf),
                     "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                     "indexer_agreement": metrics["indexer_agreement"]}
        if name == "pp2":   # without replay the shared layer has no selection on its stage: one line
            try:
                model.compute_logprobs([batch])
                out[name]["unreplayed"] = "ran"
            except ValueError as err:
                out[name]["unreplayed"] = str(err)
    teardown_model_parallel()
    return out


def test_dsa_two_rank_layouts_equal_one_rank(tiny_glm5_dir):
    ranks = run_distributed_test(_dsa_layouts, world_size=2, timeout_s=600, args=(str(tiny_glm5_dir), LAYOUTS))
    # dp2 trains the same batch on both data-parallel ranks (as does ep2, whose dense part is DP2): its
    # summed loss and gradient are twice the one-rank values that tp2 and pp2 (DP1) report
    reference = ranks[0]["dp2"]
    for rank in ranks:
        for name in LAYOUTS:
            result, copies = rank[name], (2.0 if name in ("dp2", "ep2") else 1.0)
            assert result["logp_delta"] < 2e-6, (name, result)
            assert result["export_exact"], name
            assert abs(result["loss"] * 2.0 / copies - reference["loss"]) < 1e-5, (name, result, reference)
            assert abs(result["grad_norm"] * 2.0 / copies - reference["grad_norm"]) < 1e-5 * reference["grad_norm"], name
            assert result["indexer_agreement"] == reference["indexer_agreement"] < 0.9, name
    for rank in ranks:   # refused on every rank before any collective, so no rank waits on another
        unreplayed = rank["pp2"]["unreplayed"]
        assert "reuses an earlier layer's indexer selection is on another pipeline stage" in unreplayed
        assert "\n" not in unreplayed
