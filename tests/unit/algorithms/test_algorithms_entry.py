"""The trainer's entry points: compute_policy_loss, compute_advantages, the registries (hand vectors)."""
import math

import pytest
import torch

from sao_megatron.algorithms import (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, compute_advantages, compute_policy_loss,
                                     dis_loss, get_policy_loss)
from sao_megatron.core.config import PRESETS, AlgorithmConfig
from sao_megatron.core.records import LossInputs

T = torch.tensor
RECIPES = ("sao", "grpo", "grpo_dis", "gspo", "gspo_token", "dapo", "drgrpo", "rloo", "reinforce_pp", "ppo")


def cfg_for(name, **overrides):
    fields = {k.split(".", 1)[1]: v for k, v in PRESETS[name].items() if k.startswith("algorithm.")}
    fields.update(overrides)
    return AlgorithmConfig(name=name, **fields)


def test_every_recipe_name_resolves_to_its_presets_loss_and_estimator():
    for name in RECIPES:
        assert POLICY_LOSSES[name] is POLICY_LOSSES[PRESETS[name]["algorithm.loss"]]
        assert ADVANTAGE_ESTIMATORS[name] is ADVANTAGE_ESTIMATORS[PRESETS[name]["algorithm.advantage"]]
    with pytest.raises(ValueError, match="algorithm.loss"):
        get_policy_loss("nope")


def test_sao_matches_dis_loss_and_adds_nothing_else():
    g = torch.Generator().manual_seed(1)
    logp = (torch.randn(2, 4, generator=g) * 0.5).requires_grad_(True)
    rollout, adv = torch.randn(2, 4, generator=g) * 0.5, torch.randn(2, 4, generator=g)
    mask = T([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    out = compute_policy_loss(cfg_for("sao"), LossInputs(logp, rollout, adv, mask))
    ref = dis_loss(logp, rollout, adv, mask, 0.3, 5.0)
    assert out.loss.item() == pytest.approx(ref.loss.item())
    for key in ("pg_clipfrac", "pg_clipfrac_low", "pg_clipfrac_high", "ppo_kl", "ratio_mean"):
        assert out.metrics[key].item() == pytest.approx(ref.metrics[key].item())


def _ppo_inputs():
    # logp = old = [-1, -1]: the PPO ratio is 1; rollout = [-1, -1 - ln4] -> rho = exp(old - rollout) = [1, 4]
    logp = T([[-1.0, -1.0]], requires_grad=True)
    rollout = T([[-1.0, -1.0 - math.log(4.0)]])
    return LossInputs(logp, rollout, T([[1.0, 1.0]]), torch.ones(1, 2), old_logp=logp.detach().clone())


@pytest.mark.parametrize("correction,loss,grad", [
    # TIS C = 2: w = [1, 2]; per-token -A*r*w = [-1, -2]; mean -1.5; grad -A*r*w/2 = [-.5, -1]
    ("tis", -1.5, [-0.5, -1.0]),
    # MIS [.5, 2]: rho 4 is dropped -> w = [1, 0]; loss -1/2; grad [-.5, 0]
    ("mis", -0.5, [-0.5, 0.0]),
    # IcePop [.5, 2] (same fields): identical to token MIS here
    ("icepop", -0.5, [-0.5, 0.0]),
    ("none", -1.0, [-0.5, -0.5]),
])
def test_corrections_on_ppo(correction, loss, grad):
    inputs = _ppo_inputs()
    out = compute_policy_loss(cfg_for("grpo", correction=correction, correction_low=0.5, correction_high=2.0), inputs)
    assert out.loss.item() == pytest.approx(loss, abs=1e-6)
    (g,) = torch.autograd.grad(out.loss, inputs.logp)
    assert torch.allclose(g, T([grad]), atol=1e-6)
    # mismatch_kl = mean(rollout - old) = (0 - ln4)/2 = -.693147
    assert out.metrics["mismatch_kl"].item() == pytest.approx(-math.log(4) / 2, abs=1e-6)


def test_kl_and_entropy_terms():
    # PPO on-policy, A = 1: pg = -1. KL k3 with ref -1.2 vs logp -1: .018731 per token; coef .1 -> +.0018731
    # entropy [.5, 1.5] -> mean 1, coef .01 -> -.01. total -1 + .0018731 - .01 = -1.0081269
    # grad per token: pg -1/2; KL .1*(logp - ref)/2 = .01; entropy carries none w.r.t. logp -> -.49
    inputs = _ppo_inputs()
    inputs.rollout_logp = inputs.old_logp.clone()
    inputs.ref_logp = T([[-1.2, -1.2]])
    inputs.entropy = T([[0.5, 1.5]])
    cfg = cfg_for("grpo", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    out = compute_policy_loss(cfg, inputs)
    assert out.loss.item() == pytest.approx(-1.0081269, abs=1e-6)
    (g,) = torch.autograd.grad(out.loss, inputs.logp)
    assert torch.allclose(g, T([[-0.49, -0.49]]), atol=1e-6)
    assert out.metrics["kl"].item() == pytest.approx(0.018731, abs=1e-6)
    assert out.metrics["entropy"].item() == pytest.approx(1.0)


def test_missing_inputs_and_unset_band_fail_loudly():
    inputs = _ppo_inputs()
    with pytest.raises(ValueError, match="kl_coef"):
        compute_policy_loss(cfg_for("grpo", kl_coef=0.1), inputs)
    with pytest.raises(ValueError, match="entropy_coef"):
        compute_policy_loss(cfg_for("grpo", entropy_coef=0.1), inputs)
    with pytest.raises(ValueError, match="algorithm.eps_high"):
        compute_policy_loss(AlgorithmConfig(name="grpo", loss="ppo", eps_low=0.2), inputs)


def test_custom_loss_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(
        "from sao_megatron.core.records import LossOutputs\n"
        "def sum_logp(cfg, inputs, agg, token_weight):\n"
        "    return LossOutputs(agg.loss(-inputs.logp, inputs.mask > 0), {'custom': 1.0})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    inputs = _ppo_inputs()
    out = compute_policy_loss(cfg_for("grpo", loss="my_losses:sum_logp"), inputs)
    assert out.loss.item() == pytest.approx(1.0) and out.metrics["custom"] == 1.0   # -(-1 - 1)/2
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        compute_policy_loss(cfg_for("grpo", loss="my_losses:missing"), inputs)


def test_compute_advantages_gae_decoupled_lambda():
    # r = [0, 0, 1], V = [.5, .6, .7], l = 3, alpha 1.5 -> lambda_actor = 1 - 1/4.5 = .777778
    # t2: .3; t1: .1 + .777778*.3 = .333333; t0: .1 + .777778*.333333 = .359259
    # critic lambda 1: A = [.5, .4, .3] -> returns [1, 1, 1]
    kwargs = dict(token_rewards=T([[0.0, 0.0, 1.0]]), mask=torch.ones(1, 3), values=T([[0.5, 0.6, 0.7]]),
                  seq_rewards=T([1.0]), group_ids=T([0]), response_lengths=T([3]))
    adv, ret, metrics = compute_advantages(cfg_for("sao"), **kwargs)
    assert torch.allclose(adv, T([[0.359259, 0.333333, 0.3]]), atol=1e-6)
    assert torch.allclose(ret, T([[1.0, 1.0, 1.0]]))
    assert metrics["lambda_actor_mean"] == pytest.approx(0.777778, abs=1e-6)
    # fixed lambda_actor .95 (ppo preset): the notes' vector [.46575, .385, .3]
    adv, _, _ = compute_advantages(cfg_for("ppo"), **kwargs)
    assert torch.allclose(adv, T([[0.46575, 0.385, 0.3]]), atol=1e-6)
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages(cfg_for("sao"), **{**kwargs, "values": None})


def test_compute_advantages_rejects_reward_on_padding():
    # Known bug 4: the reward on the pad token after EOS.
    with pytest.raises(ValueError, match=r"token_rewards\[0, 2\]"):
        compute_advantages(cfg_for("sao"), token_rewards=T([[0.0, 0.0, 1.0]]), mask=T([[1.0, 1.0, 0.0]]),
                           values=torch.zeros(1, 3), seq_rewards=T([1.0]), group_ids=T([0]),
                           response_lengths=T([2]))


def test_compute_advantages_group_with_overlong_shaping():
    # lengths [10, 30], L_max 32, L_cache 16 -> ramp after 16: penalties [0, (16 - 30)/16 = -.875]
    # rewards [1, 1] -> [1, .125]; GRPO on a group of two distinct values: +-(1/sqrt 2) = +-.707106
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    cfg = cfg_for("dapo", overlong_max=32, overlong_cache=16)
    adv, ret, metrics = compute_advantages(cfg, token_rewards=T([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]), mask=mask,
                                           seq_rewards=T([1.0, 1.0]), group_ids=T([4, 4]), response_lengths=T([10, 30]))
    assert ret is None
    assert torch.allclose(adv, T([[0.707106, 0.707106, 0.0], [-0.707106] * 3]), atol=1e-5)
    assert metrics["overlong_penalty_mean"] == pytest.approx(-0.4375)
    assert metrics["ds_keep_frac"] == 1.0                # dapo preset turns dynamic sampling on


def test_compute_advantages_reinforce_pp_uses_token_rewards():
    # gamma 1, rewards on the last tokens: return-to-go [[1,1,1],[2,2,0]] whitened (see advantages tests)
    adv, ret, _ = compute_advantages(cfg_for("reinforce_pp"), token_rewards=T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]),
                                     mask=T([[1, 1, 1], [1, 1, 0]]), seq_rewards=T([1.0, 2.0]), group_ids=T([0, 1]),
                                     response_lengths=T([3, 2]))
    assert ret is None and torch.allclose(adv, T([[-0.730297] * 3, [1.095445, 1.095445, 0.0]]), atol=1e-5)


def test_docs_recipe_table_matches_presets():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "algorithms.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] in PRESETS:
            rows[cells[0]] = cells
    assert set(rows) == set(PRESETS)
    for name, (_, loss, advantage, eps, _, _, _) in rows.items():
        preset = PRESETS[name]
        assert (loss, advantage) == (preset["algorithm.loss"], preset["algorithm.advantage"]), name
        low, high = (float(x) for x in eps.split("/"))
        assert (low, high) == (preset["algorithm.eps_low"], preset["algorithm.eps_high"]), name
