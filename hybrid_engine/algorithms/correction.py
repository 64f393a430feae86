"""Train/rollout mismatch correction (verl 0.9's rollout correction, decoupled mode).

The rollout engine samples from pi_rollout (its own numerics, or older weights when training
runs asynchronously); the loss is computed against pi_old, the training side's log-probs of
the same tokens. With log_ratio = log pi_old - log pi_rollout per token:

- ``rollout_is_weights``: importance weights pi_old / pi_rollout that multiply the per-token
  policy losses, truncated (TIS) or with out-of-band tokens zeroed (IcePop);
- ``rejection_mask``: drop tokens or whole sequences whose divergence estimate leaves a band;
- ``correction_metrics``: the statistics to watch (weights' mean/max/ESS, mismatch KL, PPL).
"""

from __future__ import annotations

import math

import torch

from hybrid_engine.algorithms.utils import masked_mean, masked_sum
from hybrid_engine.bands import parse_is_threshold, parse_rejection
from hybrid_engine.registry import IS_LEVELS, REJECTION_MODES

__all__ = [
    "correction_metrics",
    "parse_is_threshold",
    "parse_rejection",
    "rejection_mask",
    "rollout_correction",
    "rollout_is_weights",
]

SAFETY_BOUND = 20.0  # log-space clamp before exp: weights stay within e^±20


@torch.no_grad()
def rollout_is_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    threshold: float | str = 2.0,
    batch_normalize: bool = False,
) -> torch.Tensor:
    """Importance weights w = pi_old / pi_rollout, 0 off the mask (detached).

    token:    w_t = exp(clamp(log_ratio_t, -20, 20))
    sequence: w_t = exp(clamp(sum_t m log_ratio_t, -20, 20)) for every token of the sequence
    then TIS w = min(w, upper), or IcePop w = w if lower <= w <= upper else 0;
    batch_normalize divides by the masked mean (token) or the mean over sequences (sequence).
    """
    raw_weights = IS_LEVELS[level]
    upper, lower = parse_is_threshold(threshold)
    mask = response_mask.to(log_ratio.dtype)
    raw = raw_weights(log_ratio, response_mask) * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, 0.0)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, response_mask)
        else:
            seq = masked_sum(weights, response_mask, dim=-1) / (mask.sum(-1) + 1e-8)
            has = (mask.sum(-1) > 0).to(weights.dtype)
            mean = (seq * has).sum() / has.sum().clamp(min=1e-8)
        if mean > 1e-8:
            weights = weights / mean
    return weights


@IS_LEVELS.register("token")
def token_is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """One weight per token: w_t = exp(clamp(log_ratio_t, -20, 20))."""
    return torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))


@IS_LEVELS.register("sequence")
def sequence_is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """One weight per sequence: w = exp(clamp(sum_t m log_ratio_t, -20, 20)) on every token."""
    total = masked_sum(log_ratio, response_mask, dim=-1)[:, None]
    return torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)


# Rejection: a divergence per token (k1, k2 or k3), then a statistic over the sequence.
@REJECTION_MODES.register("token_k3", k="k3")
@REJECTION_MODES.register("token_k2", k="k2")
@REJECTION_MODES.register("token_k1", k="k1")
def token_divergence(value: torch.Tensor, m: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Each token's own divergence: drops tokens."""
    return value


@REJECTION_MODES.register("seq_sum_k3", k="k3")
@REJECTION_MODES.register("seq_sum_k2", k="k2")
@REJECTION_MODES.register("seq_sum_k1", k="k1")
def seq_sum_divergence(value: torch.Tensor, m: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The masked sum over the sequence: keeps or drops the whole sequence."""
    return masked_sum(value, m, dim=-1)[:, None]


@REJECTION_MODES.register("seq_mean_k3", k="k3")
@REJECTION_MODES.register("seq_mean_k2", k="k2")
@REJECTION_MODES.register("seq_mean_k1", k="k1")
def seq_mean_divergence(value: torch.Tensor, m: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The masked mean over the sequence: keeps or drops the whole sequence."""
    return (masked_sum(value, m, dim=-1) / (count + 1e-8))[:, None]


@REJECTION_MODES.register("seq_max_k3", k="k3")
@REJECTION_MODES.register("seq_max_k2", k="k2")
def seq_max_divergence(value: torch.Tensor, m: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The masked max over the sequence: keeps or drops the whole sequence."""
    top = value.masked_fill(~m, float("-inf")).amax(-1)
    return torch.where(torch.isinf(top), 0.0, top)[:, None]


@torch.no_grad()
def rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    modes: str = "token_k1",
    thresholds: float | str = "0.5_2.0",
) -> torch.Tensor:
    """``response_mask`` with the rejected tokens set to 0 (every mode must pass).

    Per token, with l = clamp(log_ratio, -20, 20): k1 = -l, k2 = l^2 / 2, k3 = e^l - 1 - l.
    token_k*: the token's value; seq_sum_k* / seq_mean_k* / seq_max_k*: the masked sum / mean /
    max over the sequence, which keeps or drops the whole sequence. k1 values must lie in
    [log lower, log upper]; k2 and k3 values must be <= upper.
    """
    bounds = parse_rejection(modes, thresholds)
    l_safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -l_safe, "k2": 0.5 * l_safe**2, "k3": torch.exp(l_safe) - 1.0 - l_safe}
    m = response_mask.bool()
    count = response_mask.to(log_ratio.dtype).sum(-1)
    keep = torch.ones_like(m)
    for name, (lower, upper) in bounds.items():
        kind = REJECTION_MODES.info(name)["k"]
        value = REJECTION_MODES[name](per_token[kind], m, count)
        if kind == "k1":
            ok = (value >= math.log(lower)) & (value <= math.log(upper))
        else:
            ok = value <= upper
        keep &= ok.expand_as(m)
    return (response_mask * keep.to(response_mask.dtype)).to(response_mask.dtype)


@torch.no_grad()
def correction_metrics(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    kept_mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """Mismatch statistics under ``rollout_corr/`` (verl's names): kl = E[log pi_rollout -
    log pi_old], k3_kl, training/rollout perplexity, chi2_token; with ``weights`` their mean,
    max, min and effective sample size 1 / E[(w / E w)^2]; with ``kept_mask`` the share of
    tokens and sequences the rejection dropped."""
    m = response_mask.bool()
    log_ratio = old_log_probs - rollout_log_probs
    out = {
        "kl": masked_mean(rollout_log_probs - old_log_probs, m),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, m),
        "training_ppl": torch.exp(-masked_mean(old_log_probs, m, dim=-1)).mean(),
        "rollout_ppl": torch.exp(-masked_mean(rollout_log_probs, m, dim=-1)).mean(),
        "chi2_token": masked_mean(
            torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), m
        )
        - 1.0,
    }
    if weights is not None and m.any():
        mean = masked_mean(weights, m)
        out["rollout_is_mean"] = mean
        out["rollout_is_max"] = weights.masked_fill(~m, float("-inf")).max()
        out["rollout_is_min"] = weights.masked_fill(~m, float("inf")).min()
        out["rollout_is_eff_sample_size"] = 1.0 / masked_mean((weights / (mean + 1e-8)) ** 2, m)
    if kept_mask is not None:
        dropped = m & ~kept_mask.bool()
        out["rollout_rs_masked_fraction"] = masked_mean(dropped.float(), m)
        out["rollout_rs_seq_masked_fraction"] = dropped.any(-1).float().mean()
    return {f"rollout_corr/{k}": float(v) for k, v in out.items()}


@torch.no_grad()
def rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str | None = "token",
    threshold: float | str = 2.0,
    batch_normalize: bool = False,
    rejection_modes: str | None = None,
    rejection_thresholds: float | str = "0.5_2.0",
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """What the advantage stage applies: (IS weights or None when ``level`` is None, the
    response mask after rejection, metrics). Weights and rejection both read
    log_ratio = old - rollout, the weights over the mask before rejection (as verl does)."""
    if old_log_probs.shape != rollout_log_probs.shape:
        raise ValueError(
            f"old log-probs {tuple(old_log_probs.shape)} and rollout log-probs "
            f"{tuple(rollout_log_probs.shape)} differ in shape"
        )
    log_ratio = old_log_probs - rollout_log_probs
    weights = None
    if level is not None:
        weights = rollout_is_weights(log_ratio, response_mask, level, threshold, batch_normalize)
    kept = response_mask
    if rejection_modes is not None:
        kept = rejection_mask(log_ratio, response_mask, rejection_modes, rejection_thresholds)
    metrics = correction_metrics(
        old_log_probs,
        rollout_log_probs,
        response_mask,
        weights,
        kept if rejection_modes is not None else None,
    )
    return weights, kept, metrics
