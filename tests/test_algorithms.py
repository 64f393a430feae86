"""Advantage estimators, losses and KL pieces against hand-computed numbers."""

import math

import numpy as np
import pytest
import torch
from hand import T, close

from hybrid_engine.algorithms import ADV_ESTIMATORS, get_adv_estimator, register_adv_estimator
from hybrid_engine.algorithms.advantages import (
    compute_advantage,
    gae,
    grpo,
    reinforce_plus_plus,
    remax,
    rloo,
)
from hybrid_engine.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
)
from hybrid_engine.algorithms.losses import policy_loss, value_loss
from hybrid_engine.algorithms.utils import masked_mean, masked_var, masked_whiten

pytestmark = pytest.mark.fast  # the inner loop: bash scripts/test.sh -m fast

# --------------------------------------------------------------------------- masked helpers


def test_masked_stats_ignore_padding_even_nan():
    x = T([[1.0, 2.0, float("nan")], [3.0, 6.0, 100.0]])
    mask = T([[1, 1, 0], [1, 1, 0]], torch.bool)
    close(masked_mean(x, mask), 3.0)  # (1+2+3+6)/4
    close(masked_mean(x, mask, dim=-1), [1.5, 4.5])
    close(masked_var(x, mask), 14.0 / 3)  # squared deviations 4+1+0+9 = 14, / (4-1)
    close(masked_var(x, mask, unbiased=False), 3.5)
    w = masked_whiten(x, mask)
    close(w[mask], [v / math.sqrt(14.0 / 3 + 1e-8) for v in (-2.0, -1.0, 0.0, 3.0)])
    close(masked_whiten(x, mask, shift_mean=False)[mask], (w[mask] + 3.0).tolist())
    close(masked_mean(x, torch.zeros(2, 3)), 0.0)  # empty mask: 0, not NaN


# --------------------------------------------------------------------------- advantages


def test_gae_masked_hole_passes_values_through_and_tail_is_padding():
    # gamma = lam = 0.5, so gamma*lam = 0.25. Row 0: position 1 is a hole, position 3 padding.
    #   t=3 masked -> carried V_next = A_next = 0
    #   t=2: delta = 2 + 0.5*0 - 1 = 1,              A = 1
    #   t=1 masked: V_next = 1, A_next = 1 carried (the 9.0 value must be ignored)
    #   t=0: delta = 1 + 0.5*1 - 0.5 = 1,            A = 1 + 0.25*1 = 1.25
    # Row 1 (all valid), V = [0.5, 0, 0.25, 0]:
    #   t=3: A = 0;  t=2: delta = 1 - 0.25 = 0.75, A = 0.75
    #   t=1: delta = 0.5*0.25 = 0.125, A = 0.125 + 0.25*0.75 = 0.3125
    #   t=0: delta = -0.5, A = -0.5 + 0.25*0.3125 = -0.421875
    rewards = T([[1.0, 0.0, 2.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    values = T([[0.5, 9.0, 1.0, 0.0], [0.5, 0.0, 0.25, 0.0]])
    mask = T([[1, 0, 1, 0], [1, 1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    close(ret, [[1.75, 0.0, 2.0, 0.0], [0.078125, 0.3125, 1.0, 0.0]])  # A + V
    # whiten [1.25, 1, -0.421875, 0.3125, 0.75, 0]: mean 0.4817708, unbiased var 0.4016032
    close(
        adv,
        [[1.21225, 0.0, 0.817755, 0.0], [-1.425935, -0.267106, 0.42326, -0.760225]],
    )
    assert adv.dtype == torch.float32


def test_gae_runs_without_grad():
    values = torch.zeros(1, 3, requires_grad=True)
    adv, ret = gae(torch.ones(1, 3), values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert not adv.requires_grad and not ret.requires_grad
    close(ret, [[3.0, 2.0, 1.0]])


def test_reinforce_plus_plus_carries_return_across_masked_position():
    # verl 0.9: a masked position (an observation token) passes the running return through
    # unchanged and undiscounted. gamma = 0.5. Row 0: hole at t=1, padding at t=3.
    #   G_2 = 2; t=1 carries 2; G_0 = 1 + 0.5 * 2 = 2
    # Row 1: G_2 = 3, G_1 = 1.5, G_0 = 0.75 (padding reward 7 ignored)
    rewards = T([[1.0, 0.0, 2.0, 0.0], [0.0, 0.0, 3.0, 7.0]])
    mask = T([[1, 0, 1, 0], [1, 1, 1, 0]], torch.int64)
    adv, ret = reinforce_plus_plus(rewards, mask, gamma=0.5)
    close(ret, [[2.0, 0.0, 2.0, 0.0], [0.75, 1.5, 3.0, 0.0]])
    # whiten [2, 2, 0.75, 1.5, 3]: mean 1.85, unbiased var 2.7 / 4 = 0.675, std 0.8215838
    close(adv, [[0.182574, 0.0, 0.182574, 0.0], [-1.338876, -0.426006, 1.399735, 0.0]])


def test_grpo_groups_singletons_equal_scores_and_padding():
    # group "a": scores 1 (spread over two tokens) and 0 -> mean 0.5, std sqrt(0.5)
    #            A = +-0.5 / (0.7071068 + 1e-6) = +-0.7071058
    # group "b": a single sample, score 2 -> mean 0, std 1 -> A = 2 / (1 + 1e-6)
    # group "c": all equal -> A = 0 (no NaN)
    rewards = T(
        [
            [0.5, 0.5, 0.0],
            [0.0, 0.0, 0.0],
            [0.0, 2.0, 9.0],  # 9.0 sits on padding
            [1.0, 0.0, 0.0],
            [0.0, 1.0, 0.0],
            [0.0, 0.0, 1.0],
        ]
    )
    mask = T([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    index = np.array(["a", "a", "b", "c", "c", "c"], dtype=object)
    adv, ret = grpo(rewards, mask, index)
    a = 0.7071058
    b = 2 / (1 + 1e-6)
    expected = [
        [a, a, a],
        [-a, -a, 0],
        [b, b, 0],
        [0, 0, 0],
        [0, 0, 0],
        [0, 0, 0],
    ]
    close(adv, expected)
    assert torch.equal(adv, ret)
    # Dr.GRPO: no division by std -> +-0.5, singleton keeps its score
    adv_dr, _ = grpo(rewards, mask, index, norm_by_std=False)
    close(adv_dr, [[0.5] * 3, [-0.5, -0.5, 0], [2, 2, 0], [0] * 3, [0] * 3, [0] * 3])


def test_rloo_leave_one_out_scaling_and_singleton():
    # group 0: scores [1, 2, 6], mean 3, n/(n-1) = 1.5 -> [-3, -1.5, 4.5]
    #   check: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5
    # group 7: a single sample keeps its score 5
    rewards = T([[0.0, 1.0], [2.0, 0.0], [0.0, 6.0], [5.0, 0.0]])
    mask = T([[1, 1], [1, 0], [1, 1], [1, 1]])
    adv, ret = rloo(rewards, mask, index=[0, 0, 0, 7])
    close(adv, [[-3.0, -3.0], [-1.5, 0.0], [4.5, 4.5], [5.0, 5.0]])
    assert torch.equal(adv, ret)


def test_remax_subtracts_greedy_baseline():
    # masked rewards [0, 1, 2, (5 on padding)] -> reverse cumsum [3, 3, 2, 0]; baseline 1
    rewards = T([[0.0, 1.0, 2.0, 5.0], [1.0, 0.0, 0.0, 0.0]])
    mask = T([[1, 1, 1, 0], [1, 1, 0, 0]], torch.bool)
    adv, ret = remax(rewards, T([1.0, 0.5]), mask)
    close(ret, [[3.0, 3.0, 2.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    close(adv, [[2.0, 2.0, 1.0, 0.0], [0.5, -0.5, 0.0, 0.0]])


# --------------------------------------------------------------------------- registry


def test_registry_holds_builtins_and_unknown_name_lists_them():
    assert {"gae", "grpo", "rloo", "reinforce_plus_plus", "remax"} <= set(ADV_ESTIMATORS)
    assert get_adv_estimator("rloo") is rloo
    with pytest.raises(ValueError, match="nope.*gae.*grpo.*reinforce_plus_plus.*remax.*rloo"):
        get_adv_estimator("nope")
    with pytest.raises(KeyError):
        get_adv_estimator("nope")


def test_compute_advantage_dispatches_and_names_missing_inputs():
    rewards = T([[1.0, 0.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    adv, _ = compute_advantage(
        "grpo", token_level_rewards=rewards, response_mask=mask, index=["p", "p"], norm_by_std=False
    )
    close(adv, [[0.5, 0.5], [-0.5, -0.5]])
    adv, _ = compute_advantage(
        "remax", token_level_rewards=rewards, response_mask=mask, reward_baselines=T([1.0, 0.0])
    )
    close(adv, [[0.0, -1.0], [0.0, 0.0]])
    _, ret = compute_advantage(
        "gae", token_level_rewards=rewards, response_mask=mask, values=torch.zeros(2, 2), gamma=0.5
    )
    close(ret, [[1.0, 0.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="gae needs values"):
        compute_advantage("gae", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="grpo needs index"):
        compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="remax needs reward_baselines"):
        compute_advantage("remax", token_level_rewards=rewards, response_mask=mask)


def test_register_custom_estimator_gets_only_its_parameters():
    @register_adv_estimator("_test_const")
    def const(token_level_rewards, gamma):
        return torch.full_like(token_level_rewards, gamma), token_level_rewards

    try:
        adv, _ = compute_advantage(
            "_test_const",
            token_level_rewards=torch.zeros(1, 2),
            response_mask=torch.ones(1, 2),
            gamma=0.25,
        )
        close(adv, [[0.25, 0.25]])
    finally:
        ADV_ESTIMATORS.unregister("_test_const")


# --------------------------------------------------------------------------- losses


def test_policy_loss_clip_higher_dual_clip_and_gradients():
    # old = 0 so ratio = exp(logp); low = 0.2, high = 0.28, c = 3
    # tok  ratio  A    L1     L2                       C1     final             flags
    # 1    1.5   +1   -1.5   -1.28                    -1.28  -1.28             clipped
    # 2    0.5   -1    0.5    0.8                      0.8    min(3, 0.8)=0.8   clipped
    # 3    4.0   -1    4.0    1.28                     4.0    min(3, 4)=3       lower (dual)
    # 4    1.0   +2   -2     -2                       -2     -2
    # 5    1.25  +1   -1.25  -1.25 (inside 1.28)      -1.25  -1.25             (clipped if 0.2)
    # 6    masked (ratio 10, A 5)
    # loss = (-1.28 + 0.8 + 3 - 2 - 1.25) / 5 = -0.146; clipfrac 2/5; clipfrac_lower 1/5
    ratios = [1.5, 0.5, 4.0, 1.0, 1.25, 10.0]
    log_prob = T([[math.log(r) for r in ratios]]).requires_grad_()
    old = torch.zeros(1, 6)
    adv = T([[1.0, -1.0, -1.0, 2.0, 1.0, 5.0]])
    mask = T([[1, 1, 1, 1, 1, 0]])
    loss, clipfrac, ppo_kl, clipfrac_lower = policy_loss(
        old, log_prob, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0
    )
    close(loss, -0.146)
    close(clipfrac, 0.4)
    close(clipfrac_lower, 0.2)
    close(ppo_kl, -0.264351)  # -(ln1.5 + ln0.5 + ln4 + 0 + ln1.25) / 5
    loss.backward()
    # only unclipped tokens get gradient: d(-A r)/dlogp / 5 = -A r / 5
    close(log_prob.grad, [[0.0, 0.0, 0.0, -0.4, -0.25, 0.0]])
    # symmetric 0.2 clips token 5 too
    _, clipfrac_sym, _, _ = policy_loss(old, log_prob.detach(), adv, mask)
    close(clipfrac_sym, 0.6)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(old, log_prob, adv, mask, clip_ratio_c=1.0)


def test_value_loss_clipping():
    # c = 0.2, old values 1
    # tok1 vpred 1.5 -> clipped 1.2: (1.5-2)^2 = 0.25 < (1.2-2)^2 = 0.64 -> 0.64, clipped
    # tok2 vpred 1.1 inside: (1.1-0)^2 = 1.21 both
    # tok3 vpred 0.0 -> 0.8: (0-1)^2 = 1 > (0.8-1)^2 = 0.04 -> 1
    # loss = 0.5 * (0.64 + 1.21 + 1) / 3 = 0.475; clipfrac 1/3
    vpreds = T([[1.5, 1.1, 0.0, 100.0]])
    values = torch.ones(1, 4)
    returns = T([[2.0, 0.0, 1.0, 0.0]])
    mask = T([[1, 1, 1, 0]])
    vf_loss, vf_clipfrac = value_loss(vpreds, values, returns, mask, cliprange_value=0.2)
    close(vf_loss, 0.475)
    close(vf_clipfrac, 1 / 3)


def test_kl_penalty_kinds_and_clamping():
    logp = T([0.0, -1.0, -30.0, 0.0])
    ref = T([-0.5, 0.0, 0.0, -30.0])
    close(kl_penalty(logp, ref, "k1"), [0.5, -1.0, -30.0, 30.0])
    close(kl_penalty(logp, ref, "kl"), [0.5, -1.0, -30.0, 30.0])
    close(kl_penalty(logp, ref, "abs"), [0.5, 1.0, 30.0, 30.0])
    close(kl_penalty(logp, ref, "k2"), [0.125, 0.5, 450.0, 450.0])
    close(kl_penalty(logp, ref, "mse"), [0.125, 0.5, 450.0, 450.0])
    # d = ref - logp = [-0.5, 1, 30 -> 20, -30 -> -20]; exp(d) - d - 1:
    #   e^-0.5 - 0.5 = 0.1065307; e - 2 = 0.7182818; e^20 - 21 -> 10; e^-20 + 19 -> 10
    expected_k3 = [0.1065307, 0.7182818, 10.0, 10.0]
    close(kl_penalty(logp, ref, "k3"), expected_k3)
    close(kl_penalty(logp, ref, "low_var_kl"), expected_k3)
    with pytest.raises(ValueError, match="k9"):
        kl_penalty(logp, ref, "k9")


def test_kl_controllers():
    fixed = FixedKLController(0.1)
    fixed.update(5.0, 10)
    assert fixed.value == pytest.approx(0.1)
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=1.0, horizon=100)
    ctrl.update(1.5, n_steps=10)  # error clip(0.5) = 0.2 -> x(1 + 0.2*10/100) = 1.02 -> 0.204
    assert ctrl.value == pytest.approx(0.204)
    ctrl.update(torch.tensor(0.9), n_steps=50)  # error -0.1 -> x0.95 -> 0.1938
    assert ctrl.value == pytest.approx(0.1938)
    state = ctrl.state_dict()
    assert type(state["value"]) is float
    restored = AdaptiveKLController(init_kl_coef=1.0, target_kl=1.0, horizon=100)
    restored.load_state_dict(state)
    assert restored.value == pytest.approx(0.1938)
    fixed.load_state_dict({"value": 0.3})
    assert fixed.state_dict() == {"value": pytest.approx(0.3)}


def test_apply_kl_penalty():
    # k1 = logp - ref = [[0.5, 0, -0.5, pad], [-1, 0, pad, pad]]; beta = 0.1
    scores = T([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    logp = T([[-1.0, -1.0, -1.0, 5.0], [-2.0, -2.0, 7.0, 7.0]])
    ref = T([[-1.5, -1.0, -0.5, 0.0], [-1.0, -2.0, 0.0, 0.0]])
    mask = T([[1, 1, 1, 0], [1, 1, 0, 0]])
    rewards, mean_kl = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.1, kind="k1")
    close(rewards, [[-0.05, 0.0, 1.05, 0.0], [0.1, 2.0, 0.0, 0.0]])
    close(mean_kl, -0.25)  # mean(0 / 3, -1 / 2)
