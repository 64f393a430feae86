"""The 2026 recipes in the engine: each loss trains, micro-batching leaves every aggregation
exact, rollout correction records and applies the rollout's own log-probs, a plugin's loss
runs from the config alone."""

import math

import pytest
import torch
from test_engine import SIGNAL, assert_all_changed, params

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.loop import train


@pytest.mark.parametrize("mode", ["gspo", "cispo", "sapo", "geo_mean", "gpg"])
def test_each_policy_loss_trains_a_step(mode):
    engine = Engine(
        load_config("configs/grpo_tiny.yaml", [SIGNAL, f"actor.policy_loss.mode={mode}"])
    )
    before = params(engine.actor.policy)
    metrics = engine.step(1)
    assert_all_changed(before, params(engine.actor.policy))
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor.policy_loss.mode=sapo"],
        ["actor.policy_loss.mode=geo_mean"],
        ["actor.policy_loss.mode=cispo", "actor.loss_agg_mode=token-sum"],
        [
            "actor.loss_agg_mode=seq-mean-token-sum-norm",
            "actor.entropy_coeff=0.01",
            "actor.use_kl_loss=true",
        ],
    ],
    ids=["sapo", "geo_mean", "cispo-token-sum", "drgrpo-entropy-kl"],
)
def test_micro_batching_is_exact_for_every_aggregation(overrides):
    """One mini-batch of 16 as 1, 2 or 8 micro-batches: the same gradient to float rounding.
    Each loss term is weighted by its own mode's share (tokens, sequences, rows or 1)."""
    grads = []
    for micro in (16, 2, 8):
        cfg = load_config(
            "configs/grpo_tiny.yaml",
            [
                SIGNAL,
                *overrides,
                "actor.ppo_mini_batch_size=16",
                f"actor.ppo_micro_batch_size={micro}",
                "trainer.total_training_steps=1",
                "actor.optim.lr=1e-6",
            ],
        )
        engine, _ = train(cfg)
        grads.append({k: p.grad.clone() for k, p in engine.actor.policy.named_parameters()})
    for other in grads[1:]:
        for k, g in grads[0].items():
            scale = float(g.abs().max())
            torch.testing.assert_close(other[k], g, rtol=1e-4, atol=1e-5 * scale, msg=k)


def test_rollout_correction_records_rollout_log_probs_and_weights_the_loss():
    cfg = load_config(
        "configs/grpo_tiny.yaml",
        [
            SIGNAL,
            "algorithm.rollout_correction.level=token",
            "algorithm.rollout_correction.threshold=2.0",
            "algorithm.rollout_correction.rejection_modes=token_k1",
            "algorithm.rollout_correction.rejection_thresholds=0.5_2.0",
        ],
    )
    engine = Engine(cfg)
    assert not engine.cfg.on_policy_single_update  # old log-probs are computed up front
    batch = engine.reward(engine.rollout(1))
    lp, mask = batch["rollout_log_probs"], batch["response_mask"].bool()
    assert lp.shape == mask.shape and (lp[mask] < 0).all() and (lp[~mask] == 0).all()
    adv = engine.advantage(batch)
    # same weights, same numbers: the decode loop's log-probs equal the training side's to
    # float rounding (StaticCache decode vs the packed forward), so the weights are ~1
    torch.testing.assert_close(adv["old_log_probs"][mask], lp[mask], atol=1e-4, rtol=0)
    w = adv["rollout_is_weights"]
    assert (w[~mask] == 0).all() and (w[mask] - 1).abs().max() < 1e-3
    m = adv.meta["metrics"]
    assert abs(m["rollout_corr/kl"]) < 1e-4 and m["rollout_corr/rollout_is_eff_sample_size"] > 0.999
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    # a stale rollout: pretend the sampler gave the first half of the samples 4x the
    # probability the trainer gives (ratio 0.25): token_k1 rejects them, TIS keeps w = 0.25
    stale = batch.take(list(range(len(batch))))
    stale["rollout_log_probs"] = lp.clone()
    stale["rollout_log_probs"][:8] += math.log(4.0) * mask[:8]
    adv = engine.advantage(stale)
    kept = adv["response_mask"].bool()
    assert not kept[:8].any() and torch.equal(kept[8:], mask[8:])
    torch.testing.assert_close(
        adv["rollout_is_weights"][:8][mask[:8]],
        torch.full((int(mask[:8].sum()),), 0.25),
        atol=1e-3,
        rtol=0,
    )
    assert adv.meta["metrics"]["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.5
    before = params(engine.actor.policy)
    engine.update(adv)
    assert_all_changed(before, params(engine.actor.policy))


def test_a_plugin_loss_runs_from_the_config_alone():
    with pytest.raises(ValueError, match="plugin_scaled_pg' is not a registered policy loss"):
        load_config("configs/grpo_tiny.yaml", ["actor.policy_loss.mode=plugin_scaled_pg"])
    cfg = load_config(
        "configs/grpo_tiny.yaml",
        [
            SIGNAL,
            "algorithm.plugins=[plugin_losses]",
            "actor.policy_loss.mode=plugin_scaled_pg",
        ],
    )
    engine = Engine(cfg)
    before = params(engine.actor.policy)
    metrics = engine.step(1)
    assert_all_changed(before, params(engine.actor.policy))
    assert math.isfinite(metrics["actor/pg_loss"])
