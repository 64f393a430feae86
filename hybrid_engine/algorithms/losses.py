"""Policy-gradient losses, value loss and KL penalties on (batch, response_len) tensors.

(Log-probs and entropy come from the LM head: `hybrid_engine.models.head_log_probs`.)

Losses keep their autograd graph; diagnostics (clip fractions, KL) are detached.
"""

from __future__ import annotations

import torch

from hybrid_engine.algorithms.utils import masked_mean, masked_sum

__all__ = [
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "kl_penalty",
    "policy_loss",
    "value_loss",
]

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Reduce a (batch, T) loss matrix to a scalar over the masked tokens.

    token-mean:              sum_{i,t} m l / sum_{i,t} m
    seq-mean-token-sum:      mean_i  sum_t m l
    seq-mean-token-mean:     mean_i  (sum_t m l / sum_t m), over sequences with sum_t m > 0
    seq-mean-token-sum-norm: sum_{i,t} m l / T   (T = padded response length, Dr.GRPO)
    """
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, loss_mask, dim=-1).mean()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mean = masked_mean(loss_mat, loss_mask, dim=-1)
        has_tokens = loss_mask.bool().expand_as(loss_mat).any(-1)
        return masked_mean(seq_mean, has_tokens)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return masked_sum(loss_mat, loss_mask) / loss_mat.shape[-1]
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {', '.join(LOSS_AGG_MODES)}")


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped PPO surrogate with clip-higher (asymmetric range) and dual-clip.

    ratio = exp(clamp(logp - old, -20, 20))
    L1 = -A ratio;  L2 = -A clamp(ratio, 1 - low, 1 + high);  C1 = max(L1, L2)
    L3 = -A c;      loss = C1 if A >= 0 else min(L3, C1)     (dual-clip bounds A < 0 by c)
    Returns (agg_loss(loss), clipfrac = mean[L2 > L1], ppo_kl = mean[old - logp],
    clipfrac_lower = mean[C1 > L3 and A < 0]), means over masked tokens.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    losses1 = -advantages * ratio
    losses2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_losses1 = torch.maximum(losses1, losses2)
    losses3 = -advantages * clip_ratio_c
    clip_losses2 = torch.minimum(losses3, clip_losses1)
    negative = advantages < 0
    losses = torch.where(negative, clip_losses2, clip_losses1)

    pg_loss = agg_loss(losses, response_mask, loss_agg_mode)
    with torch.no_grad():
        pg_clipfrac = masked_mean((losses2 > losses1).to(ratio.dtype), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
        lower = (clip_losses1 > losses3) & negative
        pg_clipfrac_lower = masked_mean(lower.to(ratio.dtype), response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO): the new prediction may move at most c from the old value.

    V_clip = clamp(vpred, V_old - c, V_old + c)
    loss = 0.5 agg(max((vpred - R)^2, (V_clip - R)^2));  clipfrac = mean[(V_clip - R)^2 > (vpred - R)^2]
    """
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode)
    with torch.no_grad():
        vf_clipfrac = masked_mean((clipped > unclipped).to(unclipped.dtype), response_mask)
    return vf_loss, vf_clipfrac


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman's k1/k2/k3).

    "k1" | "kl":          logp - ref
    "abs":                |logp - ref|
    "k2" | "mse":         0.5 (logp - ref)^2
    "k3" | "low_var_kl":  d = clamp(ref - logp, -20, 20);  clamp(exp(d) - d - 1, -10, 10)
    """
    diff = log_prob - ref_log_prob
    if kind in ("k1", "kl"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        d = (-diff).clamp(-20.0, 20.0)
        return (torch.exp(d) - d - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl penalty {kind!r}; known: k1, kl, abs, k2, mse, k3, low_var_kl")


class FixedKLController:
    """Constant KL coefficient: ``value`` never changes."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for the controller interface)."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): steer the observed KL towards a target.

    e = clip(KL / target - 1, -0.2, 0.2);   value <- value * (1 + e * n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-in-reward: r_t = score_t - beta * kl_t * mask_t.

    Returns (token_level_rewards, mean_kl) with mean_kl = mean_i (masked mean_t kl_{i,t}),
    a 0-d tensor (feed ``float(mean_kl)`` to a KL controller).
    """
    kl = torch.where(response_mask.bool(), kl_penalty(old_log_prob, ref_log_prob, kind), 0.0)
    rewards = token_level_scores - kl_coef * kl
    mean_kl = masked_mean(kl, response_mask, dim=-1).mean()
    return rewards, mean_kl
