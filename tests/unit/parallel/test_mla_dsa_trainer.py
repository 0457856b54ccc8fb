"""The GLM-5 / DeepSeek-V3 class in the trainer (one rank, CPU, local spec) against transformers.

- DeepSeek-V3 (dense MLA, with and without the q LoRA, plain and YaRN RoPE): trainer logprobs equal HF's.
- GLM-5 (MLA + DSA, index_topk 4 < every sequence, a "shared" indexer layer): with the engine's selection
  replayed, the trainer equals HF forced to the same selection; with replay off it does not (the
  selection is a random one no indexer would make), which is what makes this the replay test.
- train/indexer_agreement: 1.0 when the replayed selection is the trainer's own choice, low for random.
- bad input: indexer_topk of the wrong shape or with out-of-range positions is one line naming it.
- HF export returns every tensor bit for bit, the indexer's included; training leaves a frozen indexer as it was.
"""
from __future__ import annotations

import pytest
import torch

from parallel import dsa_check
from parallel import layout_check as lc

pytestmark = pytest.mark.unit

SEQ = 12


def _model_dir(tmp_path_factory, arch, preset="tiny", **overrides):
    from checkpoints.tiny_models import FIXTURE, build_tiny_model

    model = build_tiny_model(arch, 3, preset, **{**FIXTURE, **overrides}).eval()
    dsa_check.engine_norms(model)
    out = tmp_path_factory.mktemp(f"{arch}-{preset}") / "model"
    model.save_pretrained(out)
    return out, model


def _trainer(model_dir):
    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel
    from safetensors.torch import load_file

    teardown_model_parallel()
    model = RLModel.build(lc.make_recipe(model_dir, {}), "policy")
    model.load_hf_state_dict(load_file(f"{model_dir}/model.safetensors"))
    return model


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    model_dir, hf = _model_dir(tmp_path_factory, "glm5")
    return model_dir, hf, _trainer(model_dir)


@pytest.mark.parametrize("preset,rope", [("tiny", None), ("tiny-no-q-lora", None),
                                         ("tiny", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 32, "beta_fast": 32,
                                                   "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})])
def test_deepseek_v3_matches_transformers(tmp_path_factory, preset, rope):
    overrides = {"rope_parameters": rope} if rope else {}
    model_dir, hf = _model_dir(tmp_path_factory, "deepseek_v3", preset, **overrides)
    batch = lc.fixed_batches(hf.config.vocab_size, num=1, seq=SEQ)[0]
    logp = _trainer(model_dir).compute_logprobs([batch])[0][0]
    assert float((logp[:, 1:] - dsa_check.hf_token_logprobs(hf, batch.tokens)).abs().max()) < 2e-6


def test_glm5_replays_the_engines_selection(glm5):
    model_dir, hf, trainer = glm5
    kinds = list(trainer.config.sao_indexer_types)
    assert kinds == ["full", "full", "shared", "full"]
    batch = lc.fixed_batches(hf.config.vocab_size, num=1, seq=SEQ)[0]
    selection = dsa_check.random_selection(batch.tokens.shape[0], SEQ, kinds, topk=4, seed=1)
    with dsa_check.force_selection(hf, selection):
        engine = dsa_check.hf_token_logprobs(hf, batch.tokens)
    replayed = trainer.compute_logprobs([dsa_check.with_selection(batch, selection)])[0][0]
    own = trainer.compute_logprobs([batch])[0][0]
    assert float((replayed[:, 1:] - engine).abs().max()) < 2e-6
    assert float((own[:, 1:] - engine).abs().max()) > 1e-3    # replay off: the trainer attends elsewhere


def test_glm5_export_is_bit_exact_with_the_indexer(glm5):
    from safetensors.torch import load_file

    model_dir, _, trainer = glm5
    hf = load_file(f"{model_dir}/model.safetensors")
    exported = dict(trainer.export_hf())
    assert any(".self_attn.indexer.k_norm.bias" in name for name in hf)
    assert set(exported) == set(hf)
    assert all(torch.equal(exported[k], hf[k]) for k in hf)


def test_glm5_own_selection_is_transformers_with_the_shared_tie_rule(glm5):
    """The trainer's indexer picks what transformers' picks under select_topk (scores agree; only the tie
    rule is ours), and replaying that choice counts as full agreement."""
    from checkpoints.arch.dsa import select_topk

    model_dir, hf, trainer = glm5
    batch = lc.fixed_batches(hf.config.vocab_size, num=1, seq=SEQ)[0]
    chosen = {}
    for name, module in hf.named_modules():
        if name.endswith("self_attn.indexer"):
            layer = int(name.split(".")[2])
            original = module.forward
            module.forward = _capturing(module, original, layer, chosen, select_topk)
    dsa_check.hf_token_logprobs(hf, batch.tokens)
    kinds = list(trainer.config.sao_indexer_types)
    selection = torch.full((batch.tokens.shape[0], SEQ, len(kinds), 4), -1, dtype=torch.int32)
    for layer, kind in enumerate(kinds):
        selection[:, :, layer] = chosen[layer if kind == "full" else layer - 1]
    metrics = trainer.train_step([dsa_check.with_selection(batch, selection)], lc.policy_gradient_loss)
    assert metrics["indexer_agreement"] == 1.0
    random = dsa_check.random_selection(batch.tokens.shape[0], SEQ, kinds, topk=4, seed=2)
    assert trainer.train_step([dsa_check.with_selection(batch, random)], lc.policy_gradient_loss)[
        "indexer_agreement"] < 0.9
    # model.indexer_loss_coeff = 0: two steps moved the policy but not its indexers
    from safetensors.torch import load_file

    start, now = load_file(f"{model_dir}/model.safetensors"), dict(trainer.export_hf())
    indexer = [k for k in start if ".indexer." in k]
    assert indexer and all(torch.equal(now[k], start[k]) for k in indexer)
    assert not torch.equal(now["model.layers.1.self_attn.kv_b_proj.weight"], start["model.layers.1.self_attn.kv_b_proj.weight"])


def _capturing(module, original, layer, chosen, select_topk):
    def forward(hidden_states, q_resid, position_embeddings, attention_mask, *args, **kwargs):
        real_topk = torch.Tensor.topk

        def stable(scores, k, dim=-1, *a, **kw):
            picked = select_topk(scores, k)
            chosen[layer] = picked.int()
            return torch.return_types.topk((scores.gather(-1, picked.clamp(min=0)), picked.clamp(min=0)))
        torch.Tensor.topk = stable
        try:
            return original(hidden_states, q_resid, position_embeddings, attention_mask, *args, **kwargs)
        finally:
            torch.Tensor.topk = real_topk
    return forward


@pytest.mark.parametrize("bad,match", [(lambda s: s[:, :, :3], r"indexer_topk has shape .*expected \[rows, seq, 4, 4\]"),
                                       (lambda s: s + 100, r"outside \[-1, 11\]")])
def test_bad_indexer_topk_is_one_line(glm5, bad, match):
    model_dir, hf, trainer = glm5
    batch = lc.fixed_batches(hf.config.vocab_size, num=1, seq=SEQ)[0]
    selection = dsa_check.random_selection(batch.tokens.shape[0], SEQ, list(trainer.config.sao_indexer_types), 4)
    with pytest.raises(ValueError, match=match) as err:
        trainer.compute_logprobs([dsa_check.with_selection(batch, bad(selection))])
    assert "\n" not in str(err.value)


def test_latent_norms_use_the_engines_epsilon(tmp_path):
    """SGLang 0.5.23 and Megatron give the MLA latent norms rms_norm_eps; transformers hard-codes 1e-6.
    The reference server follows SGLang, read from the wheel."""
    from sglang_wheel import load_sources

    from checkpoints.tiny_models import FIXTURE, build_tiny_model
    from rollout.engines.reference_server.model_runner import ModelRunner

    source = load_sources()["sglang/srt/models/deepseek_v2.py"]
    assert "self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)" in source
    assert "self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)" in source
    model = build_tiny_model("glm5", 0, "tiny", **FIXTURE, rms_norm_eps=1e-5)
    model.save_pretrained(tmp_path)
    served = ModelRunner(tmp_path, max_batch=1).model
    norms = [m.variance_epsilon for n, m in served.named_modules() if n.endswith(("q_a_layernorm", "kv_a_layernorm"))]
    assert norms and set(norms) == {1e-5}


def _one_step(model_dir, batch, **model_fields):
    from dataclasses import replace as dc_replace

    from parallel.distributed import teardown_model_parallel
    from parallel.rl_model import RLModel
    from safetensors.torch import load_file

    teardown_model_parallel()
    recipe = lc.make_recipe(model_dir, {})
    recipe.model = dc_replace(recipe.model, **model_fields)
    trainer = RLModel.build(recipe, "policy")
    start = load_file(f"{model_dir}/model.safetensors")
    trainer.load_hf_state_dict(start)
    metrics = trainer.train_step([batch], lc.policy_gradient_loss)
    return metrics, start, dict(trainer.export_hf())


def test_replay_holds_under_full_recompute_and_the_indexer_loss_trains_the_indexer(glm5):
    """Full activation recompute re-runs every layer's forward in backward: it must attend to the same
    replayed keys (equal loss, gradient and weights after the step). With model.indexer_loss_coeff > 0
    Megatron's indexer KL loss moves the indexers and nothing else changes in the forward."""
    model_dir, hf, trainer = glm5
    batch = lc.fixed_batches(hf.config.vocab_size, num=1, seq=SEQ)[0]
    selection = dsa_check.random_selection(batch.tokens.shape[0], SEQ, list(trainer.config.sao_indexer_types), 4, 3)
    batch = dsa_check.with_selection(batch, selection)
    plain, start, after_plain = _one_step(model_dir, batch)
    recomputed, _, after_recompute = _one_step(model_dir, batch, recompute="full")
    assert abs(plain["loss"] - recomputed["loss"]) < 1e-6 and abs(plain["grad_norm"] - recomputed["grad_norm"]) < 1e-6
    assert all(torch.allclose(after_plain[k], after_recompute[k], atol=1e-6) for k in start)
    trained, _, after_trained = _one_step(model_dir, batch, indexer_loss_coeff=0.1)
    indexer = [k for k in start if ".indexer." in k]
    assert all(torch.equal(after_plain[k], start[k]) for k in indexer)
    assert any(not torch.equal(after_trained[k], start[k]) for k in indexer)
    assert abs(trained["loss"] - plain["loss"]) < 1e-6   # the indexer loss rides on the gradient only


def test_each_micro_batch_of_a_step_attends_its_own_replayed_keys(glm5):
    """A training step's forwards see the same logprobs as the no-grad pass, micro-batch by micro-batch
    (the second must not take the first one's selection once the first's backward has run)."""
    model_dir, hf, trainer = glm5
    kinds = list(trainer.config.sao_indexer_types)
    batches = [dsa_check.with_selection(b, dsa_check.random_selection(b.tokens.shape[0], SEQ, kinds, 4, seed=10 + i))
               for i, b in enumerate(lc.fixed_batches(hf.config.vocab_size, num=2, seq=SEQ, seed=4))]
    expected = [logp for logp, _ in trainer.compute_logprobs(batches)]
    seen = []

    def loss_fn(batch, outputs):
        seen.append(outputs["logp"].detach().clone())
        return lc.policy_gradient_loss(batch, outputs)

    trainer.train_step(batches, loss_fn)
    assert len(seen) == 2
    for got, want in zip(seen, expected):
        assert float((got - want).abs().max()) < 1e-6


def test_a_checkpoint_whose_indexer_shape_differs_is_one_line(glm5):
    from safetensors.torch import load_file

    model_dir, _, trainer = glm5
    tensors = load_file(f"{model_dir}/model.safetensors")
    tensors["model.layers.1.self_attn.indexer.wk.weight"] = torch.zeros(8, 64)
    with pytest.raises(Exception, match=r"indexer\.wk\.weight: HF tensors give shape \(8, 64\) .* the model has "
                                        r"\(16, 64\); config.json and weights disagree") as err:
        trainer.load_hf_state_dict(tensors)
    assert "\n" not in str(err.value)
