"""Policy-gradient losses, their aggregation, the value loss and the entropy reference.

Every tensor is (batch, response_len) with a 0/1 ``response_mask``. Policy losses are
registered by name (``actor.policy_loss.mode``); each is verl 0.9's
``compute_policy_loss_<mode>`` at one data-parallel rank: the same value, the same gradient
with respect to ``log_prob`` (the stop-gradients sit where verl puts them) and the same
diagnostics. A loss returns ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``; the three
diagnostics are detached. (Log-probs and entropy of the policy itself come from the fused
LM head, ``hybrid_engine.models.logprobs.head_log_probs``; ``entropy_from_logits`` is the plain
reference it is tested against.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybrid_engine.algorithms.utils import masked_mean, masked_sum
from hybrid_engine.registry import LOSS_AGG_MODES, POLICY_LOSSES

__all__ = [
    "PolicyLoss",
    "agg_loss",
    "band_clip_fractions",
    "cispo_loss",
    "entropy_from_logits",
    "geo_mean_loss",
    "get_policy_loss",
    "gpg_loss",
    "gspo_loss",
    "loss_aggregation",
    "policy_loss",
    "register_policy_loss",
    "sapo_loss",
    "vanilla_loss",
    "value_loss",
]


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a (batch, T) loss matrix to a scalar over the masked tokens (verl 0.9, one rank)
    with the registered aggregation ``loss_agg_mode``. Sequences without a masked token count
    in no mean; an all-masked batch gives 0."""
    return LOSS_AGG_MODES[loss_agg_mode](loss_mat, loss_mask, loss_scale_factor)


def _seqs(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The mask as bools, which sequences have a masked token, and how many (at least 1)."""
    m = loss_mask.bool().expand_as(loss_mat)
    has_tokens = m.any(-1)
    return m, has_tokens, has_tokens.sum().clamp(min=1).to(loss_mat.dtype)


@LOSS_AGG_MODES.register("token-mean")
def token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor, _scale: float | None = None):
    """sum_{i,t} m l / sum_{i,t} m"""
    return masked_mean(loss_mat, loss_mask)


@LOSS_AGG_MODES.register("token-sum")
def token_sum(loss_mat: torch.Tensor, loss_mask: torch.Tensor, _scale: float | None = None):
    """sum_{i,t} m l"""
    return masked_sum(loss_mat, loss_mask)


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, _scale: float | None = None
) -> torch.Tensor:
    """sum_i (sum_t m l) / S, S = sequences with a masked token"""
    m, _, n_seqs = _seqs(loss_mat, loss_mask)
    return masked_sum(loss_mat, m, dim=-1).sum() / n_seqs


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, _scale: float | None = None
) -> torch.Tensor:
    """sum_i (sum_t m l / (sum_t m + 1e-8)) / S"""
    m, has_tokens, n_seqs = _seqs(loss_mat, loss_mask)
    seq_mean = masked_sum(loss_mat, m, dim=-1) / (m.sum(-1).to(loss_mat.dtype) + 1e-8)
    return masked_sum(seq_mean, has_tokens) / n_seqs


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_scale_factor: float | None = None
) -> torch.Tensor:
    """seq-mean-token-sum / loss_scale_factor (default: T, Dr.GRPO)"""
    scale = loss_scale_factor or loss_mat.shape[-1]
    return seq_mean_token_sum(loss_mat, loss_mask) / scale


# ----------------------------------------------------------------------------- registry
PolicyLossOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss. ``aggregation`` is the reduction it always uses (None: the
    configured ``actor.loss_agg_mode``); "seq-mean" is a plain mean over sequences."""

    fn: Callable[..., PolicyLossOut]
    aggregation: str | None = None

    @property
    def summary(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0]


def register_policy_loss(
    name: str, aggregation: str | None = None
) -> Callable[[Callable[..., PolicyLossOut]], Callable[..., PolicyLossOut]]:
    """Decorator: register ``fn(old_log_prob, log_prob, advantages, response_mask, **kw)`` as
    loss ``name`` (the plugin spelling of ``POLICY_LOSSES.register``). ``kw`` holds every
    keyword of `policy_loss` after ``response_mask`` (take the ones you need, end with
    ``**_``); return the 4-tuple of `policy_loss`."""
    return POLICY_LOSSES.register(name, aggregation=aggregation)


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered as ``name``; the error lists the registered ones."""
    return PolicyLoss(POLICY_LOSSES[name], POLICY_LOSSES.info(name).get("aggregation"))


def loss_aggregation(loss_mode: str, loss_agg_mode: str) -> str:
    """How loss ``loss_mode`` reduces its tokens when the config says ``loss_agg_mode``."""
    return get_policy_loss(loss_mode).aggregation or loss_agg_mode


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    loss_mode: str = "vanilla",
    rollout_is_weights: torch.Tensor | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    loss_scale_factor: float | None = None,
) -> PolicyLossOut:
    """The registered loss ``loss_mode``: (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower).

    ``rollout_is_weights`` (train/rollout mismatch correction, detached) multiplies the
    per-token losses before aggregation."""
    return get_policy_loss(loss_mode).fn(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        loss_scale_factor=loss_scale_factor,
    )


def band_clip_fractions(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token shares where the PPO band binds, by side (TRL's ``clip_ratio/low_mean`` and
    ``clip_ratio/high_mean``), for any loss mode, on the token ratio r = exp(logp - old):

    low = mean[r < 1 - low and A < 0];  high = mean[r > 1 + high and A > 0]    (detached)
    """
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0))
    low = (ratio < 1.0 - clip_ratio_low) & (advantages < 0)
    high = (ratio > 1.0 + clip_ratio_high) & (advantages > 0)
    return _frac(low, response_mask), _frac(high, response_mask)


def _is_weighted(losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return losses if rollout_is_weights is None else losses * rollout_is_weights


def _frac(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(condition.float(), mask).detach()


# ----------------------------------------------------------------------------- the losses
@POLICY_LOSSES.register("vanilla")
def vanilla_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    clip_ratio_low,
    clip_ratio_high,
    clip_ratio_c,
    loss_agg_mode,
    rollout_is_weights=None,
    loss_scale_factor=None,
    **_,
) -> PolicyLossOut:
    """PPO-clip with clip-higher (asymmetric range) and dual-clip.

    r = exp(clamp(logp - old, -20, 20));  L1 = -A r;  L2 = -A clamp(r, 1 - low, 1 + high)
    C1 = max(L1, L2);  loss = C1 if A >= 0 else min(-A c, C1)      (dual-clip bounds A < 0)
    clipfrac = mean[L2 > L1];  clipfrac_lower = mean[C1 > -A c and A < 0]
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    losses1 = -advantages * ratio
    losses2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_losses1 = torch.maximum(losses1, losses2)
    losses3 = -advantages * clip_ratio_c
    negative = advantages < 0
    losses = torch.where(negative, torch.minimum(losses3, clip_losses1), clip_losses1)
    losses = _is_weighted(losses, rollout_is_weights)
    pg_loss = agg_loss(losses, response_mask, loss_agg_mode, loss_scale_factor)
    return (
        pg_loss,
        _frac(losses2 > losses1, response_mask),
        masked_mean(-log_ratio, response_mask).detach(),
        _frac((clip_losses1 > losses3) & negative, response_mask),
    )


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    clip_ratio_low,
    clip_ratio_high,
    loss_agg_mode,
    rollout_is_weights=None,
    loss_scale_factor=None,
    **_,
) -> PolicyLossOut:
    """GSPO: PPO-clip on the sequence's length-normalised ratio (the paper: seq-mean-token-mean).

    log s_i = sum_t m (logp - old) / |y_i|   (the geometric mean of the token ratios)
    s_it = exp(min(sg[log s_i] + logp - sg[logp], 10))   value s_i, gradient s_i dlogp_t
    loss = agg max(-A s_it, -A clamp(s_it, 1 - low, 1 + high));  clipfrac_lower = 0
    """
    neg_kl = log_prob - old_log_prob
    lengths = response_mask.sum(-1).clamp(min=1)
    seq_log_ratio = masked_sum(neg_kl, response_mask, dim=-1) / lengths
    log_s = (log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10.0)
    s = torch.exp(log_s)
    losses1 = -advantages * s
    losses2 = -advantages * s.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = _is_weighted(torch.maximum(losses1, losses2), rollout_is_weights)
    pg_loss = agg_loss(losses, response_mask, loss_agg_mode, loss_scale_factor)
    zero = torch.zeros((), device=pg_loss.device)
    return (
        pg_loss,
        _frac(losses2 > losses1, response_mask),
        masked_mean(-neg_kl, response_mask).detach(),
        zero,
    )


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    clip_ratio_low,
    clip_ratio_high,
    loss_agg_mode,
    rollout_is_weights=None,
    loss_scale_factor=None,
    **_,
) -> PolicyLossOut:
    """CISPO: REINFORCE weighted by the clipped, stop-gradient importance ratio.

    r = exp(clamp(logp - old, -20, 20));  loss = agg -sg[clamp(r, 1 - low, 1 + high)] A logp
    (every token keeps a gradient, sg[clip(r)] A); clipfrac = mean[r outside the band]
    """
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = _is_weighted(-clipped.detach() * advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(losses, response_mask, loss_agg_mode, loss_scale_factor)
    zero = torch.zeros((), device=pg_loss.device)
    return (
        pg_loss,
        _frac(ratio != clipped, response_mask),
        masked_mean(-log_ratio, response_mask).detach(),
        zero,
    )


@POLICY_LOSSES.register("geo_mean", aggregation="seq-mean")
def geo_mean_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    clip_ratio_low,
    clip_ratio_high,
    rollout_is_weights=None,
    **_,
) -> PolicyLossOut:
    """GMPO: the geometric mean of token-clipped ratios; a plain mean over sequences.

    d = logp - old (no clamp);  d' = sign(A) min(sign(A) d, sign(A) clamp(d, -low, high))
    rho_i = exp(sum_t m d' / (|y_i| + 1e-8));  A_i = sum_t m A / (|y_i| + 1e-8)
    loss = mean_i -A_i rho_i [w_i],  w_i = exp(sum_t m log(w_t + 1e-10) / (|y_i| + 1e-8))
    clipfrac (A > 0) / clipfrac_lower (A < 0) = mean[d clamped]
    """
    neg_kl = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = neg_kl.clamp(-clip_ratio_low, clip_ratio_high)
    neg_kl_min = sign * torch.minimum(sign * neg_kl, sign * clamped)
    length = response_mask.sum(-1) + 1e-8
    ratio = torch.exp(masked_sum(neg_kl_min, response_mask, dim=-1) / length)
    advantage = masked_sum(advantages, response_mask, dim=-1) / length
    losses = -advantage * ratio
    if rollout_is_weights is not None:
        log_w = masked_sum(torch.log(rollout_is_weights + 1e-10), response_mask, dim=-1)
        losses = losses * torch.exp(log_w / length)
    clipped = neg_kl != clamped
    return (
        losses.mean(),
        _frac(clipped & (advantages > 0), response_mask),
        masked_mean(-neg_kl, response_mask).detach(),
        _frac(clipped & (advantages < 0), response_mask),
    )


@POLICY_LOSSES.register("gpg")
def gpg_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode,
    rollout_is_weights=None,
    loss_scale_factor=None,
    **_,
) -> PolicyLossOut:
    """GPG: plain policy gradient, no ratio and no clipping: loss = agg -logp A.

    (verl reports no diagnostics for it: clipfrac 0, ppo_kl = mean(old - logp) for reference.)
    """
    losses = _is_weighted(-log_prob * advantages, rollout_is_weights)
    pg_loss = agg_loss(losses, response_mask, loss_agg_mode, loss_scale_factor)
    zero = torch.zeros((), device=pg_loss.device)
    ppo_kl = masked_mean(old_log_prob - log_prob, response_mask).detach()
    return pg_loss, zero, ppo_kl, zero


@POLICY_LOSSES.register("sapo", aggregation="seq-mean-token-mean")
def sapo_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    tau_pos,
    tau_neg,
    rollout_is_weights=None,
    **_,
) -> PolicyLossOut:
    """SAPO: a smooth sigmoid gate on the token ratio instead of a hard clip.

    r = exp(clamp(logp - old, -20, 20));  tau = tau_pos if A > 0 else tau_neg
    f(r) = sigmoid(tau (r - 1)) 4 / tau   (slope 1 at r = 1);  loss = agg -f(r) A,
    always seq-mean-token-mean; clipfrac = clipfrac_lower = 0
    """
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pos = torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device)
    neg = torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device)
    taus = torch.where(advantages > 0, pos, neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    losses = _is_weighted(-gates * advantages, rollout_is_weights)
    pg_loss = agg_loss(losses, response_mask, "seq-mean-token-mean")
    zero = torch.zeros((), device=pg_loss.device)
    return pg_loss, zero, masked_mean(-log_ratio, response_mask).detach(), zero


# ----------------------------------------------------------------------------- value, entropy
def value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO): the new prediction may move at most c from the old value.

    V_clip = clamp(vpred, V_old - c, V_old + c)
    loss = 0.5 agg(max((vpred - R)^2, (V_clip - R)^2));  clipfrac = mean[(V_clip - R)^2 > (vpred - R)^2]
    """
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.maximum(unclipped, clipped), response_mask, loss_agg_mode, loss_scale_factor
    )
    return vf_loss, _frac(clipped > unclipped, response_mask)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension: H = logsumexp(z) - sum_v p_v z_v.

    The plain reference (verl's formula); training uses the fused head, which computes
    -sum p log p in chunks without this function's (…, vocab) temporaries."""
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)
