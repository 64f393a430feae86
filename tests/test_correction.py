"""Rollout correction (train/rollout mismatch, verl 0.9): IS weights, rejection, metrics."""

import math

import pytest
import torch
from hand import T, close

from hybrid_engine.algorithms.correction import (
    correction_metrics,
    parse_rejection,
    rejection_mask,
    rollout_is_weights,
)

pytestmark = pytest.mark.fast  # the inner loop: bash scripts/test.sh -m fast

LN = math.log
# log pi_old - log pi_rollout; row 0 has a padding position holding a huge ratio
LOG_RATIO = T([[LN(3.0), LN(0.5), LN(1.5), 50.0], [LN(1.2), LN(1.0), 0.0, 0.0]])
MASK = T([[1, 1, 1, 0], [1, 1, 0, 0]])


def test_token_weights_truncated_or_icepop_and_zero_off_the_mask():
    close(rollout_is_weights(LOG_RATIO, MASK, "token", 2.0), [[2.0, 0.5, 1.5, 0], [1.2, 1, 0, 0]])
    # IcePop keeps [0.6, 2.0] and zeroes the rest (3 and 0.5)
    close(rollout_is_weights(LOG_RATIO, MASK, "token", "0.6_2.0"), [[0, 0, 1.5, 0], [1.2, 1, 0, 0]])
    # batch normalised: TIS weights [2, 0.5, 1.5, 1.2, 1] have mean 1.24
    w = rollout_is_weights(LOG_RATIO, MASK, "token", 2.0, batch_normalize=True)
    close(w, [[2 / 1.24, 0.5 / 1.24, 1.5 / 1.24, 0], [1.2 / 1.24, 1 / 1.24, 0, 0]])
    assert not w.requires_grad


def test_sequence_weights_are_the_product_of_token_ratios():
    # row 0: 3 * 0.5 * 1.5 = 2.25 -> truncated to 2; row 1: 1.2 * 1 = 1.2
    close(rollout_is_weights(LOG_RATIO, MASK, "sequence", 2.0), [[2, 2, 2, 0], [1.2, 1.2, 0, 0]])
    # threshold 3 keeps 2.25; batch-normalised over sequences: mean of (2.25, 1.2) = 1.725
    close(
        rollout_is_weights(LOG_RATIO, MASK, "sequence", 3.0, batch_normalize=True),
        [[2.25 / 1.725] * 3 + [0], [1.2 / 1.725] * 2 + [0, 0]],
    )
    with pytest.raises(ValueError, match="unknown IS level 'geometric'"):
        rollout_is_weights(LOG_RATIO, MASK, "geometric")


def test_rejection_token_and_sequence_modes():
    # token_k1 keeps pi_rollout / pi_old in [0.5, 2]: ratios 1/3 (out), 2, 2/3, 1/1.2, 1
    close(rejection_mask(LOG_RATIO, MASK, "token_k1", "0.5_2.0"), [[0, 1, 1, 0], [1, 1, 0, 0]])
    # "2.0" alone for a k1 mode means [1/2, 2]
    close(rejection_mask(LOG_RATIO, MASK, "token_k1", 2.0), [[0, 1, 1, 0], [1, 1, 0, 0]])
    # seq_max_k2: max of l^2 / 2 per sequence: row 0 (ln 3)^2 / 2 = 0.6035 > 0.5 drops the row,
    # row 1 (ln 1.2)^2 / 2 = 0.0166 stays
    close(rejection_mask(LOG_RATIO, MASK, "seq_max_k2", 0.5), [[0, 0, 0, 0], [1, 1, 0, 0]])
    # seq_mean_k3 = mean(e^l - 1 - l): row 0 (0.9014 + 0.1931 + 0.0945) / 3 = 0.3963, row 1 0.0118
    close(rejection_mask(LOG_RATIO, MASK, "seq_mean_k3", 0.3), [[0, 0, 0, 0], [1, 1, 0, 0]])
    close(rejection_mask(LOG_RATIO, MASK, "seq_mean_k3", 0.4), MASK.tolist())
    # several modes: every one must pass
    close(
        rejection_mask(LOG_RATIO, MASK, "token_k1,seq_sum_k2", "0.5_2.0,0.05"),
        [[0, 0, 0, 0], [1, 1, 0, 0]],
    )
    assert rejection_mask(LOG_RATIO, MASK.long()).dtype == torch.long


def test_rejection_specs_are_checked_by_name():
    assert parse_rejection("token_k1,seq_max_k3", "0.5_2.0,0.4") == {
        "token_k1": (0.5, 2.0),
        "seq_max_k3": (None, 0.4),
    }
    with pytest.raises(ValueError, match="unknown rejection mode 'seq_max_k1'"):
        parse_rejection("seq_max_k1", 2.0)
    with pytest.raises(
        ValueError, match="threshold for token_k2 '0.1_2': expected one upper bound"
    ):
        parse_rejection("token_k2", "0.1_2")
    with pytest.raises(ValueError, match="one for all modes or one per mode"):
        parse_rejection("token_k1,token_k2,token_k3", "2,3")


def test_metrics_mismatch_kl_and_effective_sample_size():
    old = T([[-1.0, -2.0]])
    rollout = T([[-1.5, -2.0]])  # log ratio [0.5, 0]
    w = T([[2.0, 1.0]])
    m = correction_metrics(old, rollout, torch.ones(1, 2), w, T([[1, 0]]))
    assert m["rollout_corr/kl"] == pytest.approx(-0.25)  # mean(rollout - old)
    assert m["rollout_corr/k3_kl"] == pytest.approx((math.exp(0.5) - 1.5) / 2)
    # ESS = 1 / mean((w / 1.5)^2) = 1 / ((16/9 + 4/9) / 2) = 0.9
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(0.9, abs=1e-6)
    assert m["rollout_corr/rollout_is_max"] == 2.0
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.5
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0
