"""The estimators added for the 2026 recipes (verl 0.9 semantics), against hand-computed values,
and the registry as the one source of what an estimator needs."""

import pytest
import torch
from hand import T, close

from hybrid_engine.algorithms.advantages import (
    compute_advantage,
    gpg,
    grpo_passk,
    opo,
    reinforce_plus_plus_baseline,
)
from hybrid_engine.registry import ADV_ESTIMATORS, estimator_needs

pytestmark = pytest.mark.fast  # the inner loop: bash scripts/test.sh -m fast


def outcome(scores, lengths, width=3):
    """Rewards with each score on the last response token; mask of the given lengths."""
    mask = torch.zeros(len(scores), width)
    rewards = torch.zeros(len(scores), width)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


def test_grpo_passk_only_the_best_sample_learns():
    # group a: scores [1, 0, 3, 2]: best 3, second 2 -> 1; unbiased std of [1, 0, 3, 2] is
    #   sqrt(5 / 3) = 1.2909944 -> A = 1 / (1.2909944 + 1e-6) = 0.7745961 on row 2 only
    # group b: [0, 0]: best - second = 0 -> 0 everywhere
    rewards, mask = outcome([1, 0, 3, 2, 0, 0], [3, 2, 1, 3, 3, 3])
    index = ["a", "a", "a", "a", "b", "b"]
    adv, ret = grpo_passk(rewards, mask, index)
    close(adv, [[0] * 3, [0] * 3, [0.7745961, 0, 0], [0] * 3, [0] * 3, [0] * 3])
    assert torch.equal(adv, ret)
    adv, _ = grpo_passk(rewards, mask, index, norm_by_std=False)
    close(adv[2], [1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="grpo_passk.*'c' has 1"):
        grpo_passk(rewards[:5], mask[:5], ["a", "a", "a", "a", "c"])


def test_reinforce_plus_plus_baseline_group_mean_then_batch_whitening():
    # group a: [1, 0] - 0.5 = [0.5, -0.5]; group b (one sample, baseline 0): [2]
    # over the masked tokens (lengths 2, 1, 2): [0.5, 0.5, -0.5, 2, 2]
    #   mean 0.9, unbiased var 4.7 / 4 = 1.175 -> (x - 0.9) / sqrt(1.175 + 1e-8)
    rewards, mask = outcome([1, 0, 2], [2, 1, 2])
    adv, ret = reinforce_plus_plus_baseline(rewards, mask, ["a", "a", "b"])
    z = [(x - 0.9) / 1.175**0.5 for x in (0.5, -0.5, 2.0)]
    close(adv, [[z[0], z[0], 0], [z[1], 0, 0], [z[2], z[2], 0]])
    assert torch.equal(adv, ret)


def test_opo_length_weighted_baseline():
    # group a: scores [1, 0, 1], lengths [2, 3, 1]: b = (2*1 + 3*0 + 1*1) / 6 = 0.5
    # group b: a single sample keeps its score 4
    rewards, mask = outcome([1, 0, 1, 4], [2, 3, 1, 3])
    adv, _ = opo(rewards, mask, ["a", "a", "a", "b"])
    close(adv, [[0.5, 0.5, 0], [-0.5] * 3, [0.5, 0, 0], [4.0] * 3])


def test_gpg_scales_by_share_of_nonzero_scores():
    # scores [1, 0, 0, 3]: 2 of 4 nonzero -> alpha = 4 / 2 = 2 (the alpha argument is ignored,
    # as in verl 0.9); groups a = [1, 0] (mean 0.5), b = [0, 3] (mean 1.5)
    # A = 2 (s - mean) / f_norm: f_norm 1 -> [1, -1, -3, 3]; f_norm 2 -> half
    rewards, mask = outcome([1, 0, 0, 3], [1, 1, 1, 1], width=1)
    adv, _ = gpg(rewards, mask, ["a", "a", "b", "b"], alpha=7.0)
    close(adv, [[1.0], [-1.0], [-3.0], [3.0]])
    adv, _ = gpg(rewards, mask, ["a", "a", "b", "b"], f_norm=2.0)
    close(adv, [[0.5], [-0.5], [-1.5], [1.5]])


def test_needs_come_from_the_registered_signature():
    assert estimator_needs("gae") == {"values"}
    assert estimator_needs("remax") == {"reward_baselines"}
    for name in ("grpo", "rloo", "grpo_passk", "opo", "gpg", "reinforce_plus_plus_baseline"):
        assert estimator_needs(name) == {"index"}, name
    assert estimator_needs("reinforce_plus_plus") == frozenset()

    @ADV_ESTIMATORS.register("_test_critic_baseline")
    def critic_baseline(token_level_rewards, response_mask, values):
        adv = (token_level_rewards - values) * response_mask
        return adv, adv

    try:
        assert estimator_needs("_test_critic_baseline") == {"values"}
        adv, _ = compute_advantage(
            "_test_critic_baseline",
            token_level_rewards=T([[1.0, 2.0]]),
            response_mask=T([[1, 0]]),
            values=T([[0.25, 0.0]]),
        )
        close(adv, [[0.75, 0.0]])
    finally:
        ADV_ESTIMATORS.unregister("_test_critic_baseline")
