"""The 2026 policy losses (verl 0.9 semantics) against values and gradients computed by hand.

Each case sets old log-probs to 0 (or states them), so the log-ratio d = logp - old is given
directly; the comments carry the arithmetic."""

import math

import pytest
import torch
from hand import T, close

from hybrid_engine.algorithms.losses import (
    agg_loss,
    entropy_from_logits,
    get_policy_loss,
    loss_aggregation,
    policy_loss,
    register_policy_loss,
)
from hybrid_engine.models.logprobs import head_log_probs
from hybrid_engine.registry import POLICY_LOSSES

pytestmark = pytest.mark.fast  # the inner loop: bash scripts/test.sh -m fast


def run(loss_mode, old, d, adv, mask, **kw):
    """policy_loss at logp = old + d; returns its four outputs and d(pg_loss)/d(logp)."""
    logp = (old + d).clone().requires_grad_()
    out = policy_loss(old, logp, adv, mask, loss_mode=loss_mode, **kw)
    out[0].backward()
    return out, logp.grad


def test_agg_loss_verl09_modes():
    # rows: tokens [1, 2] | [4, 5, 6] | nothing (NaN in the padding must not leak)
    loss = T([[1.0, 2.0, 3.0, 4.0], [4.0, 5.0, 6.0, 7.0], [float("nan"), 8.0, 9.0, 10.0]])
    mask = T([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    close(agg_loss(loss, mask, "token-mean"), 3.6)  # 18 / 5 tokens
    close(agg_loss(loss, mask, "token-sum"), 18.0)
    close(agg_loss(loss, mask, "seq-mean-token-sum"), 9.0)  # (3 + 15) / 2 sequences with tokens
    close(agg_loss(loss, mask, "seq-mean-token-mean"), 3.25)  # (1.5 + 5) / 2
    # Dr.GRPO: the seq-mean-token-sum over a constant, by default the padded length 4
    close(agg_loss(loss, mask, "seq-mean-token-sum-norm"), 2.25)  # 9 / 4
    close(agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=32), 9 / 32)
    close(agg_loss(loss, torch.zeros(3, 4), "seq-mean-token-mean"), 0.0)  # nothing: 0, no NaN
    with pytest.raises(ValueError, match="bogus.*token-sum"):
        agg_loss(loss, mask, "bogus")


def gspo_three_sequences(mode: str, scale: float | None = None):
    """GSPO on three sequences (clip band [0.8, 1.28]) under aggregation `mode`."""
    old = torch.zeros(3, 3)
    d = T([[0.1, 0.3, 0.0], [0.5, 0.5, 9.0], [0.4, 0.4, 0.4]])
    adv = T([[1.0] * 3, [-1.0] * 3, [1.0] * 3])
    mask = T([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_scale_factor": scale}
    return run("gspo", old, d, adv, mask, loss_agg_mode=mode, **kw)


def test_gspo_sequence_ratio_value_and_stop_gradient():
    # s_i = exp(mean_t d) per sequence
    # seq 1: A = +1, d = [0.1, 0.3]      s = e^0.2 = 1.2214028 inside the band: loss -1.2214028
    # seq 2: A = -1, d = [0.5, 0.5] (+ a padding 9.0 that must not count)
    #        s = e^0.5 = 1.6487213; max(1.6487, 1.28) is the unclipped one: loss +1.6487213
    # seq 3: A = +1, d = [0.4, 0.4, 0.4] s = e^0.4 = 1.4918247 > 1.28: clipped, loss -1.28
    # pg_loss = mean over sequences (seq-mean-token-mean) = (-1.2214028 + 1.6487213 - 1.28) / 3
    # gradient: s_it = sg[s_i] * exp(logp_t - sg[logp_t]), so ds_it/dlogp_t = s_i (the sequence's
    # ratio, equal for every token, not the token's own ratio e^d_t):
    #   seq 1: -s_1 / (3 seqs * 2 tokens) = -0.2035671;  seq 2: +s_2 / 6 = 0.2747869;  seq 3: 0
    (loss, clipfrac, ppo_kl, lower), grad = gspo_three_sequences("seq-mean-token-mean")
    close(loss, -0.2842272)
    close(grad, [[-0.2035671] * 2 + [0.0], [0.2747869] * 2 + [0.0], [0.0] * 3])
    close(clipfrac, 3 / 7)  # seq 3's three tokens
    close(ppo_kl, -2.6 / 7)  # -(0.1 + 0.3 + 0.5 + 0.5 + 1.2) / 7
    close(lower, 0.0)


# The same three sequences through verl 0.9.1's own `compute_policy_loss_gspo` (the PyPI wheel,
# FSDPActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28), loss_scale_factor set through
# `config.global_batch_info` as verl's losses.py does): (mode, loss_scale_factor) -> pg_loss and
# the gradient of seq 1 and seq 2 (seq 3 is clipped: 0). Token losses -s_1 = -1.2214028 (x2),
# +s_2 = 1.6487212 (x2), -1.28 (x3): token-sum = -2.985363, token-mean = that / 7, and so on.
VERL_091_GSPO = {
    ("token-mean", None): (-0.4264804, -0.1744861, 0.2355316),
    ("token-sum", None): (-2.9853630, -1.2214028, 1.6487212),
    ("seq-mean-token-sum", None): (-0.9951210, -0.4071343, 0.5495738),
    ("seq-mean-token-mean", None): (-0.2842272, -0.2035671, 0.2747869),
    ("seq-mean-token-sum-norm", None): (-0.3317070, -0.1357114, 0.1831913),
    ("seq-mean-token-sum-norm", 32): (-0.0310975, -0.0127229, 0.0171742),
}


@pytest.mark.parametrize(("mode", "scale"), list(VERL_091_GSPO))
def test_gspo_honours_every_aggregation_mode_as_verl_091(mode, scale):
    (loss, clipfrac, ppo_kl, _), grad = gspo_three_sequences(mode, scale)
    value, g1, g2 = VERL_091_GSPO[mode, scale]
    close(loss, value)
    close(grad, [[g1, g1, 0.0], [g2, g2, 0.0], [0.0] * 3])
    close(clipfrac, 3 / 7)  # the diagnostics do not depend on the mode
    close(ppo_kl, -2.6 / 7)
    assert loss_aggregation("gspo", mode) == mode


def test_cispo_every_token_keeps_a_clipped_stop_gradient_weight():
    # old = [-1, -2, -1], d = [0.5, 0, -0.5] -> logp = [-0.5, -2, -1.5]
    # r = [1.6487, 1, 0.6065] -> sg[clip(r, 0.8, 1.28)] = [1.28, 1, 0.8];  A = [1, 1, -2]
    # token losses -c A logp = [0.64, 2.0, -2.4];  token-mean = 0.24 / 3 = 0.08
    # gradient -c A / 3 = [-0.4266667, -0.3333333, 0.5333333]: the clipped tokens 1 and 3 still
    # get one (PPO-clip would give them 0), scaled by the clipped ratio
    old = T([[-1.0, -2.0, -1.0]])
    (loss, clipfrac, ppo_kl, lower), grad = run(
        "cispo",
        old,
        T([[0.5, 0.0, -0.5]]),
        T([[1.0, 1.0, -2.0]]),
        torch.ones(1, 3),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    close(loss, 0.08)
    close(grad, [[-1.28 / 3, -1 / 3, 1.6 / 3]])
    close(clipfrac, 2 / 3)
    close(ppo_kl, 0.0)
    close(lower, 0.0)


def test_sapo_gate_and_fixed_sequence_aggregation():
    # f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = 1 (A > 0) or 1.05 (A <= 0)
    # seq 1: r = 1 on both tokens: f = 2 / tau -> losses [-2, +1.9047619], seq mean -0.0476190
    # seq 2: r = 2, A = +1: f = 4 sigmoid(1) = 2.9242344 -> loss -2.9242344
    # pg_loss = (-0.0476190 - 2.9242344) / 2 = -1.4859267 (token-mean would be -1.0064908)
    # gradient: f'(r) = 4 sigmoid'(tau (r - 1)), times dr/dlogp = r, times -A / (2 seqs * tokens):
    #   seq 1: f'(1) = 1 -> [-0.25, +0.25];  seq 2: 4 * 0.1966119 * 2 / 2 = 0.7864477 -> -0.7864477
    (loss, clipfrac, ppo_kl, lower), grad = run(
        "sapo",
        torch.zeros(2, 2),
        T([[0.0, 0.0], [math.log(2), 0.0]]),
        T([[1.0, -1.0], [1.0, 0.0]]),
        T([[1, 1], [1, 0]]),
        loss_agg_mode="token-mean",
    )
    close(loss, -1.4859267)
    close(grad, [[-0.25, 0.25], [-0.7864477, 0.0]])
    close(clipfrac, 0.0)
    close(lower, 0.0)
    close(ppo_kl, -math.log(2) / 3)


def test_geo_mean_token_clipped_geometric_ratio():
    # band [-0.2, 0.28] on d; for A > 0 the token keeps min(d, clamp(d)), for A < 0 max(...)
    # seq 1: A = +1, d = [0.1, 0.5] -> [0.1, 0.28]; rho = exp(0.38 / 2) = 1.2092496; loss -rho
    # seq 2: A = -1, d = [-0.5, 0.1] -> [-0.2, 0.1]; rho = exp(-0.1 / 2) = 0.9512294; loss +rho
    # pg_loss = plain mean over the 2 sequences = -0.1290101
    # gradient reaches only unclipped tokens: drho/dd_t = rho / 2, over 2 sequences:
    #   seq 1 token 1: -1.2092496 / 4;  seq 2 token 2: +0.9512294 / 4
    (loss, clipfrac, ppo_kl, lower), grad = run(
        "geo_mean",
        torch.zeros(2, 2),
        T([[0.1, 0.5], [-0.5, 0.1]]),
        T([[1.0, 1.0], [-1.0, -1.0]]),
        torch.ones(2, 2),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    close(loss, -0.1290101)
    close(grad, [[-0.3023124, 0.0], [0.0, 0.2378074]])
    close(clipfrac, 0.25)  # seq 1 token 2 (A > 0)
    close(lower, 0.25)  # seq 2 token 1 (A < 0)
    close(ppo_kl, -0.05)


def test_gpg_and_rollout_is_weights_scale_token_losses():
    # gpg: -logp A, token-mean over 2 tokens: logp = [-1, -2], A = [1, -1] -> (1 - 2) / 2 = -0.5
    # with IS weights [2, 0.5]: (2 * 1 + 0.5 * -2) / 2 = 0.5; gradient -A w / 2 = [-1, 0.25]
    old = T([[-1.0, -2.0]])
    (loss, *_), _ = run("gpg", old, torch.zeros(1, 2), T([[1.0, -1.0]]), torch.ones(1, 2))
    close(loss, -0.5)
    (loss, *_), grad = run(
        "gpg",
        old,
        torch.zeros(1, 2),
        T([[1.0, -1.0]]),
        torch.ones(1, 2),
        rollout_is_weights=T([[2.0, 0.5]]),
    )
    close(loss, 0.5)
    close(grad, [[-1.0, 0.25]])
    # vanilla with weights: r = 1 everywhere, -A r w, token-mean: (-2 + 0.5) / 2 = -0.75
    (loss, *_), grad = run(
        "vanilla",
        old,
        torch.zeros(1, 2),
        T([[1.0, -1.0]]),
        torch.ones(1, 2),
        rollout_is_weights=T([[2.0, 0.5]]),
    )
    close(loss, -0.75)
    close(grad, [[-1.0, 0.25]])


def test_registry_is_the_source_of_loss_names_and_aggregation():
    assert {"vanilla", "gspo", "cispo", "geo_mean", "gpg", "sapo"} <= set(POLICY_LOSSES)
    assert loss_aggregation("sapo", "token-mean") == "seq-mean-token-mean"
    assert loss_aggregation("gspo", "token-sum") == "token-sum"
    assert loss_aggregation("cispo", "seq-mean-token-sum-norm") == "seq-mean-token-sum-norm"
    assert loss_aggregation("geo_mean", "token-mean") == "seq-mean"
    assert get_policy_loss("gspo").summary.startswith("GSPO")
    with pytest.raises(ValueError, match="nope.*cispo.*gspo"):
        policy_loss(
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1, 1),
            torch.ones(1, 1),
            loss_mode="nope",
        )

    @register_policy_loss("_test_double")
    def double(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, **_):
        """A test loss: twice the plain policy gradient."""
        pg = agg_loss(-2 * log_prob * advantages, response_mask, loss_agg_mode)
        zero = torch.zeros(())
        return pg, zero, zero, zero

    try:
        (loss, *_), grad = run(
            "_test_double", torch.zeros(1, 2), T([[-1.0, -3.0]]), T([[1.0, 1.0]]), torch.ones(1, 2)
        )
        close(loss, 4.0)
        close(grad, [[-1.0, -1.0]])
    finally:
        POLICY_LOSSES.unregister("_test_double")


def test_entropy_reference_agrees_with_the_fused_head():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    hidden = torch.randn(40, 16) * 3
    logits = head(hidden) / 0.7
    # uniform logits: H = log V
    close(entropy_from_logits(torch.zeros(2, 5)), [math.log(5)] * 2)
    _, fused = head_log_probs(head, hidden, torch.zeros(40, dtype=torch.long), 0.7, True)
    torch.testing.assert_close(fused, entropy_from_logits(logits), atol=1e-5, rtol=0)


def test_only_older_gspo_runs_get_their_old_aggregation():
    from storage.semantics import SEMANTICS, as_recorded

    def doc(mode="gspo", agg="token-mean", **kw):
        actor = {"loss_agg_mode": agg, "policy_loss": {"mode": mode}}
        return {"run_id": "r", "config": {"actor": actor}, "created_at": 1796200000.0} | kw

    config, notes = as_recorded(doc())
    assert config["actor"]["policy_loss"]["aggregation"] == "seq-mean-token-mean"
    assert len(notes) == 1 and "trained with seq-mean-token-mean, not token-mean" in notes[0]
    assert doc()["config"]["actor"]["policy_loss"] == {"mode": "gspo"}  # a copy changed
    for kept in (
        doc(semantics=SEMANTICS),  # recorded by this code
        doc(created_at=1796300000.0),  # by the code between 87ae0d0 and the record
        doc(mode="vanilla"),
        doc(agg="seq-mean-token-mean"),  # the same loss either way
    ):
        assert as_recorded(kept) == (kept["config"], [])
