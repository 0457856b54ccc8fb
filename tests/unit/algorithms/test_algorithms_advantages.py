"""Hand-computed vectors for advantages, shaping and filters (arithmetic in the comments)."""
import math

import pytest
import torch

from sao_megatron.algorithms import (compute_gae, drgrpo_advantages, dynamic_sampling_filter, grpo_advantages,
                                     length_adaptive_lambda, overlong_penalty, place_scalar_reward,
                                     reinforce_pp_advantages, reinforce_pp_baseline_advantages, rloo_advantages,
                                     whiten)

T = torch.tensor


def close(a, b, tol=1e-5):
    return torch.allclose(a, T(b, dtype=torch.float32), atol=tol)


def test_gae_lambda_095_and_1():
    # r = [0, 0, 1], V = [.5, .6, .7], gamma = 1.
    # lambda .95: t2: d = 1 - .7 = .3, A = .3;  t1: d = .7 - .6 = .1, A = .1 + .95*.3 = .385
    #             t0: d = .6 - .5 = .1, A = .1 + .95*.385 = .46575
    # lambda 1: A = [.5, .4, .3], R = A + V = [1, 1, 1] (Monte-Carlo returns)
    r, v, m = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), torch.ones(1, 3)
    adv, ret = compute_gae(r, v, m, 1.0, 0.95)
    assert close(adv, [[0.46575, 0.385, 0.3]])
    adv, ret = compute_gae(r, v, m, 1.0, 1.0)
    assert close(adv, [[0.5, 0.4, 0.3]]) and close(ret, [[1.0, 1.0, 1.0]])


def test_gae_skips_observation_tokens_with_discount():
    # mask [1, 1, 0, 1] (token 2 is tool output: r = 99 and V = 42 must be ignored), gamma .9, lambda .5
    # V = [1, 2, 42, 3], r = [0, 1, 99, 2]
    # t3: d = 2 + 0 - 3 = -1, A3 = -1, R3 = 2
    # t1 (next action token is t3): d = 1 + .9*3 - 2 = 1.7, A1 = 1.7 + .45*(-1) = 1.25, R1 = 3.25
    # t0: d = 0 + .9*2 - 1 = .8, A0 = .8 + .45*1.25 = 1.3625, R0 = 2.3625
    r, v = T([[0.0, 1.0, 99.0, 2.0]]), T([[1.0, 2.0, 42.0, 3.0]])
    adv, ret = compute_gae(r, v, T([[1.0, 1.0, 0.0, 1.0]]), 0.9, 0.5)
    assert close(adv, [[1.3625, 1.25, 0.0, -1.0]]) and close(ret, [[2.3625, 3.25, 0.0, 2.0]])


def test_gae_notes_skip_vector_and_padding_after_eos():
    # mask [1, 0, 1], r = [0, 99, 1], V = [.5, 42, .7], lambda 1: A2 = .3, A0 = (0 + .7 - .5) + .3 = .5
    adv, _ = compute_gae(T([[0.0, 99.0, 1.0]]), T([[0.5, 42.0, 0.7]]), T([[1.0, 0.0, 1.0]]), 1.0, 1.0)
    assert close(adv, [[0.5, 0.0, 0.3]])
    # Padding after EOS: mask [1, 1, 0, 0], r = [0, 1, 0, 0], V = [.2, .4, 9, 9]
    # t1: d = 1 - .4 = .6; t0: d = .4 - .2 = .2, A0 = .8; the 9s never enter.
    adv, ret = compute_gae(T([[0.0, 1.0, 0.0, 0.0]]), T([[0.2, 0.4, 9.0, 9.0]]), T([[1.0, 1.0, 0.0, 0.0]]), 1.0, 1.0)
    assert close(adv, [[0.8, 0.6, 0.0, 0.0]]) and close(ret, [[1.0, 1.0, 0.0, 0.0]])


def test_gae_per_sequence_lambda():
    # Same row twice, lambda = [0, 1]. lambda 0: A = delta = [.1, .1, .3]; lambda 1: [.5, .4, .3]
    r, v = T([[0.0, 0.0, 1.0]] * 2), T([[0.5, 0.6, 0.7]] * 2)
    adv, _ = compute_gae(r, v, torch.ones(2, 3), 1.0, T([0.0, 1.0]))
    assert close(adv, [[0.1, 0.1, 0.3], [0.5, 0.4, 0.3]])


def test_length_adaptive_lambda():
    # alpha 1.5: l=1: 1 - 1/1.5 = 1/3; l=2: 1 - 1/3 = 2/3; l=4: 1 - 1/6 = 5/6; l=100: 1 - 1/150; l=0 -> 0
    lam = length_adaptive_lambda(T([1, 2, 4, 100, 0]), 1.5)
    assert close(lam, [1 / 3, 2 / 3, 5 / 6, 1 - 1 / 150, 0.0])
    # alpha .5, l=1: 1 - 2 = -1 -> clamped to 0
    assert close(length_adaptive_lambda(T([1]), 0.5), [0.0])
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(T([1]), 0.0)


def test_place_scalar_reward_uses_last_action_token():
    # row 1's last action token sits after an observation token; row 2 has no action token.
    mask = T([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    out = place_scalar_reward(T([2.0, 3.0, 4.0]), mask)
    assert close(out, [[0, 2, 0, 0], [0, 0, 3, 0], [0, 0, 0, 0]])


def test_grpo_drgrpo_rloo_vectors():
    # group 0 rewards [1, 0, 0, 1]: mean .5, unbiased var = 4*.25/3 = 1/3, std .577350 -> +-.5/.577351 = +-.866024
    # group 7 rewards [2, 4, 9]: mean 5, dev [-3, -1, 4], unbiased var 26/2 = 13, std 3.605551
    #   GRPO [-.832050, -.277350, 1.109400]; Dr.GRPO [-3, -1, 4]
    #   RLOO: 2 - (4+9)/2 = -4.5; 4 - (2+9)/2 = -1.5; 9 - (2+4)/2 = 6
    # group 3 (a single sample) -> 0 everywhere.
    rewards = T([1.0, 2.0, 0.0, 4.0, 0.0, 9.0, 1.0, 5.0])
    groups = T([0, 7, 0, 7, 0, 7, 0, 3])
    assert close(grpo_advantages(rewards, groups),
                 [0.866024, -0.832050, -0.866024, -0.277350, -0.866024, 1.109400, 0.866024, 0.0])
    assert close(drgrpo_advantages(rewards, groups), [0.5, -3, -0.5, -1, -0.5, 4, 0.5, 0])
    # RLOO group 0: 1 - 1/3 = .666667, 0 - 2/3 = -.666667
    assert close(rloo_advantages(rewards, groups), [2 / 3, -4.5, -2 / 3, -1.5, -2 / 3, 6.0, 2 / 3, 0.0])


def test_whiten_and_reinforce_pp():
    # whiten [1, 2, 3, 4] (+ a masked 100): mean 2.5, unbiased var 5/3, std 1.290994
    x = whiten(T([[1.0, 2.0, 3.0, 4.0, 100.0]]), T([[1, 1, 1, 1, 0]]))
    assert close(x, [[-1.161895, -0.387298, 0.387298, 1.161895, 0.0]])
    # REINFORCE++ gamma 1: rewards [[0,0,1],[0,2,0]], mask [[1,1,1],[1,1,0]] -> return-to-go [[1,1,1],[2,2,0]]
    # tokens [1,1,1,2,2]: mean 1.4, unbiased var (3*.16 + 2*.36)/4 = .3, std .547723
    # -> -.4/.547723 = -.730297, .6/.547723 = 1.095445
    r, m = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]), T([[1, 1, 1], [1, 1, 0]])
    assert close(reinforce_pp_advantages(r, m, 1.0), [[-0.730297] * 3, [1.095445, 1.095445, 0.0]])
    # gamma .5: returns [[.25, .5, 1], [1, 2, 0]]; mean 4.75/5 = .95; dev [-.7, -.45, .05, .05, 1.05]
    # unbiased var (.49 + .2025 + .0025 + .0025 + 1.1025)/4 = .45, std .670820
    assert close(reinforce_pp_advantages(r, m, 0.5), [[-1.043498, -0.670820, 0.074536], [0.074536, 1.565248, 0.0]])


def test_reinforce_pp_baseline():
    # groups [0,0,1,1], rewards [1,0,3,3] -> r - mean = [.5, -.5, 0, 0]; row lengths [2, 1, 1, 2]
    # tokens [.5, .5, -.5, 0, 0, 0]: mean 1/12 = .083333; dev [.416667 x2, -.583333, -.083333 x3]
    # unbiased var (2*.173611 + .340278 + 3*.006944)/5 = .708333/5 = .141667, std .376386
    # -> .416667/.376386 = 1.107019; -.583333/.376386 = -1.549826; -.083333/.376386 = -.221404
    mask = T([[1, 1], [1, 0], [1, 0], [1, 1]])
    out = reinforce_pp_baseline_advantages(T([1.0, 0.0, 3.0, 3.0]), T([0, 0, 1, 1]), mask)
    assert close(out, [[1.107019, 1.107019], [-1.549826, 0], [-0.221404, 0], [-0.221404, -0.221404]])


def test_dynamic_sampling_filter():
    # groups 0 (all 1) and 2 (all 0) and 3 (single sample) carry no signal; group 1 is mixed.
    keep = dynamic_sampling_filter(T([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 5.0]), T([0, 0, 1, 1, 2, 2, 3]))
    assert keep.tolist() == [False, False, True, True, False, False, False]


def test_overlong_penalty():
    # L_max 20480, L_cache 4096 -> ramp starts after 16384: (16384 - l)/4096
    # 16385 -> -1/4096; 18432 -> -2048/4096 = -.5; 20480 -> -1; 20481 -> -1 (over L_max)
    out = overlong_penalty(T([100, 16384, 16385, 18432, 20480, 20481]), 20480, 4096)
    assert close(out, [0.0, 0.0, -1 / 4096, -0.5, -1.0, -1.0], tol=1e-7)
    assert close(overlong_penalty(T([10**6]), 0, 0), [0.0])
    with pytest.raises(ValueError, match="overlong_cache"):
        overlong_penalty(T([1]), 100, 200)


def test_gae_matches_direct_definition_on_a_long_random_batch():
    # A_t = sum_k (gamma*lam)^k delta_{t+k} over the compacted action tokens, computed directly.
    g = torch.Generator().manual_seed(0)
    rows, width, gamma, lam = 3, 40, 0.97, 0.9
    mask = (torch.rand(rows, width, generator=g) > 0.3).float()
    r, v = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
    adv, _ = compute_gae(r, v, mask, gamma, lam)
    for i in range(rows):
        idx = torch.nonzero(mask[i]).squeeze(-1).tolist()
        vals = [float(v[i, t]) for t in idx] + [0.0]
        deltas = [float(r[i, t]) + gamma * vals[j + 1] - vals[j] for j, t in enumerate(idx)]
        for j, t in enumerate(idx):
            direct = sum((gamma * lam) ** k * deltas[j + k] for k in range(len(idx) - j))
            assert math.isclose(float(adv[i, t]), direct, abs_tol=1e-4)


def test_running_mean_baseline_hand_values():
    from sao_megatron.algorithms import running_mean_advantages

    # first batch: no baseline yet -> b_prev = mean([1, 0, 0, 1]) = 0.5; A = r - 0.5;
    # b_new = 0.9 * 0.5 + 0.1 * 0.5 = 0.5
    adv, b = running_mean_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), None, 0.9)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5] and b == pytest.approx(0.5)
    # next batch all 1: A = 1 - 0.5 = 0.5 each; b = 0.9 * 0.5 + 0.1 * 1 = 0.55
    adv, b = running_mean_advantages(torch.tensor([1.0, 1.0]), b, 0.9)
    assert adv.tolist() == [0.5, 0.5] and b == pytest.approx(0.55)


def test_running_mean_estimator_through_compute_advantages():
    from sao_megatron.algorithms import compute_advantages
    from sao_megatron.core.config import AlgorithmConfig

    cfg = AlgorithmConfig(name="running_mean", loss="ppo", advantage="running_mean", eps_low=0.2, eps_high=0.2)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv, returns, metrics = compute_advantages(cfg, token_rewards=rewards, mask=mask, seq_rewards=torch.tensor([1.0, 0.0]),
                                               group_ids=torch.tensor([0, 1]), response_lengths=torch.tensor([2.0, 1.0]),
                                               baseline=0.25)
    # A = r - 0.25 on action tokens only; b_new = 0.9 * 0.25 + 0.1 * 0.5 = 0.275
    assert adv.tolist() == [[0.75, 0.75, 0.0], [-0.25, 0.0, 0.0]]
    assert returns is None and metrics["running_baseline"] == pytest.approx(0.275)
