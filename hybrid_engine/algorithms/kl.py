"""KL between the policy and the reference: per-token estimators, the KL-in-reward
penalty, and the fixed/adaptive coefficient controllers."""

from __future__ import annotations

import torch

from hybrid_engine.algorithms.utils import masked_mean
from hybrid_engine.registry import KL_ESTIMATORS

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "kl_controller",
    "kl_penalty",
]


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs with the registered
    estimator ``kind`` (Schulman's k1/k2/k3 and their verl aliases)."""
    return KL_ESTIMATORS[kind](log_prob - ref_log_prob)


@KL_ESTIMATORS.register("kl")
@KL_ESTIMATORS.register("k1")
def k1(diff: torch.Tensor) -> torch.Tensor:
    """logp - ref"""
    return diff


@KL_ESTIMATORS.register("abs")
def abs_kl(diff: torch.Tensor) -> torch.Tensor:
    """|logp - ref|"""
    return diff.abs()


@KL_ESTIMATORS.register("mse")
@KL_ESTIMATORS.register("k2")
def k2(diff: torch.Tensor) -> torch.Tensor:
    """0.5 (logp - ref)^2"""
    return 0.5 * diff.square()


@KL_ESTIMATORS.register("low_var_kl")
@KL_ESTIMATORS.register("k3")
def k3(diff: torch.Tensor) -> torch.Tensor:
    """d = clamp(ref - logp, -20, 20);  clamp(exp(d) - d - 1, -10, 10)"""
    d = (-diff).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1).clamp(-10.0, 10.0)


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


def kl_controller(
    type: str, kl_coef: float, target_kl: float, horizon: float
) -> AdaptiveKLController | FixedKLController:
    """The controller `algorithm.kl_ctrl`'s fields describe: `type` "adaptive" or "fixed"."""
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    return FixedKLController(kl_coef)
