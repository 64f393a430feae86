"""Advantage estimators: token-level rewards -> (advantages, returns).

Every tensor is (batch, response_len); ``response_mask`` is non-zero on response tokens.
``index`` holds one hashable group id per sample (same id = same prompt). Each estimator runs
under ``torch.no_grad()``, returns float tensors shaped like the rewards and zeroes both outputs
at masked-out positions.

Estimators are registered by name; ``compute_advantage(name, ...)`` calls one with just the
inputs its signature asks for, and ``hybrid_engine.registry.estimator_needs(name)`` reads from that signature what
the engine must provide (a critic, prompt groups, a greedy baseline).

Outcome scores are s_i = sum_t r_t mask_t. verl 0.9 sums every position; the pipeline's
rewards are zero off the mask, so the two agree, and padding that holds garbage is not read.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from hybrid_engine.algorithms.utils import masked_whiten
from hybrid_engine.registry import ADV_ESTIMATORS, ESTIMATOR_INPUTS

__all__ = [
    "compute_advantage",
    "gae",
    "get_adv_estimator",
    "gpg",
    "grpo",
    "grpo_passk",
    "opo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]

AdvOut = tuple[torch.Tensor, torch.Tensor]


def get_adv_estimator(name: str) -> Callable[..., AdvOut]:
    """The estimator registered as ``name``; the error lists the registered ones."""
    return ADV_ESTIMATORS[name]


def compute_advantage(
    name: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
) -> AdvOut:
    """Call the estimator ``name`` with the keyword arguments its signature accepts.

    A parameter is filled from the argument of the same name. A required parameter left
    ``None`` (e.g. ``values`` for "gae") raises ``ValueError("gae needs values (a critic)")``;
    a parameter with a default that was not given here keeps its default.
    """
    fn = get_adv_estimator(name)
    given: dict[str, Any] = {
        "token_level_rewards": token_level_rewards,
        "response_mask": response_mask,
        "index": index,
        "values": values,
        "reward_baselines": reward_baselines,
        "gamma": gamma,
        "lam": lam,
        "norm_by_std": norm_by_std,
    }
    kwargs: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        value = given.get(param.name)
        if value is not None:
            kwargs[param.name] = value
        elif param.default is param.empty:
            raise ValueError(f"{name} needs {ESTIMATOR_INPUTS.get(param.name, param.name)}")
    return fn(**kwargs)


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.float()


def _group_ids(index: Sequence[Hashable], batch: int, device: torch.device) -> torch.Tensor:
    """Map arbitrary hashable ids to 0..G-1 (first-seen order)."""
    if isinstance(index, torch.Tensor):  # 0-d tensors hash by identity, so use Python values
        index = index.tolist()
    ids: dict[Hashable, int] = {}
    gid = [ids.setdefault(g, len(ids)) for g in index]
    if len(gid) != batch:
        raise ValueError(f"index has {len(gid)} entries for a batch of {batch}")
    return torch.tensor(gid, dtype=torch.long, device=device)


def _group_stats(scores: torch.Tensor, index: Sequence[Hashable]) -> tuple[torch.Tensor, ...]:
    """Per sample: (group size n, group mean, unbiased group std); std is 0 where n == 1."""
    gid = _group_ids(index, scores.shape[0], scores.device)
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count.index_add_(0, gid, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, gid, scores)
    mean = (total / count)[gid]
    sq = torch.zeros_like(count).index_add_(0, gid, (scores - mean) ** 2)
    var = sq / (count - 1).clamp(min=1)
    return count[gid], mean, var.sqrt()[gid]


def _scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample outcome score: sum_t r_t * mask_t."""
    return torch.where(response_mask.bool(), _as_float(token_level_rewards), 0.0).sum(-1)


def _broadcast(adv: torch.Tensor, response_mask: torch.Tensor) -> AdvOut:
    """A per-sample advantage on every token of its response; returns = advantages."""
    advantages = torch.where(response_mask.bool(), adv[:, None], 0.0)
    return advantages, advantages


@ADV_ESTIMATORS.register("gae")
@torch.no_grad()
def gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> AdvOut:
    """Generalised Advantage Estimation (PPO with a critic).

    Backward over t, starting from V_next = A_next = 0:
        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
    and then V_next, A_next <- V_t, A_t only where mask_t = 1 (a masked position passes the
    carried values through, so a hole in the response is skipped).
    returns = A + V (before whitening); advantages = whiten(A) over the mask. Both x mask.
    """
    rewards = _as_float(token_level_rewards)
    values = values.to(rewards)
    keep = response_mask.bool()
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(next_value)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        next_adv = torch.where(keep[:, t], adv, next_adv)
        advantages[:, t] = next_adv
    returns = torch.where(keep, advantages + values, 0.0)
    return torch.where(keep, masked_whiten(advantages, keep), 0.0), returns


@ADV_ESTIMATORS.register("grpo")
@torch.no_grad()
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> AdvOut:
    """Group-relative outcome advantage (GRPO; Dr.GRPO with ``norm_by_std=False``).

    s_i = sum_t r_{i,t} mask_{i,t};  per prompt group: mean mu and unbiased std sigma
    (a group of one uses mu = 0, sigma = 1).
        A_i = (s_i - mu) / (sigma + epsilon)   or   A_i = s_i - mu   (Dr.GRPO)
    broadcast over the sample's tokens, x mask; returns = advantages.
    """
    scores = _scores(token_level_rewards, response_mask)
    n, mean, std = _group_stats(scores, index)
    single = n < 2
    mean = torch.where(single, 0.0, mean)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (torch.where(single, 1.0, std) + epsilon)
    return _broadcast(adv, response_mask)


@ADV_ESTIMATORS.register("rloo")
@torch.no_grad()
def rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
) -> AdvOut:
    """REINFORCE Leave-One-Out: baseline = mean score of the *other* samples of the group.

    s_i - (sum_j s_j - s_i) / (n - 1)  =  (s_i - mean) * n / (n - 1)   for n > 1;
    a group of one keeps A_i = s_i. Broadcast over tokens, x mask; returns = advantages.
    """
    scores = _scores(token_level_rewards, response_mask)
    n, mean, _ = _group_stats(scores, index)
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores)
    return _broadcast(adv, response_mask)


@ADV_ESTIMATORS.register("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> AdvOut:
    """REINFORCE++: whitened discounted return-to-go.

    Backward over t with G = 0:  G_t = r_t + gamma * G  where mask_t = 1, and then G <- G_t;
    a masked position (an observation token of a multi-turn trajectory, or padding) carries
    G through unchanged, undiscounted, as verl 0.9 does: a final reward reaches every turn.
    advantages = whiten(G) over the mask, x mask; returns = G x mask.
    """
    keep = response_mask.bool()
    rewards = torch.where(keep, _as_float(token_level_rewards), 0.0)
    returns = torch.zeros_like(rewards)
    carried = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        returns[:, t] = rewards[:, t] + gamma * carried
        carried = torch.where(keep[:, t], returns[:, t], carried)
    returns = torch.where(keep, returns, 0.0)
    return torch.where(keep, masked_whiten(returns, keep), 0.0), returns


@ADV_ESTIMATORS.register("remax")
@torch.no_grad()
def remax(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> AdvOut:
    """ReMax: return-to-go minus the reward of a greedy rollout of the same prompt.

    returns_t = sum_{k >= t} r_k mask_k;   A_t = (returns_t - b) * mask_t,  b of shape (batch,).
    """
    keep = response_mask.bool()
    rewards = torch.where(keep, _as_float(token_level_rewards), 0.0)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    returns = torch.where(keep, returns, 0.0)
    baseline = reward_baselines.to(rewards).reshape(-1, 1)
    return torch.where(keep, returns - baseline, 0.0), returns


@ADV_ESTIMATORS.register("grpo_passk")
@torch.no_grad()
def grpo_passk(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> AdvOut:
    """Pass@k advantage (Chen et al. 2025): only the best sample of a group learns.

    Per group (at least 2 samples): the best sample (torch.topk's first) gets
        A = (s_max - s_second) / (std + epsilon)   (unbiased std; without it if not norm_by_std)
    every other sample 0. Broadcast over tokens, x mask; returns = advantages.
    """
    scores = _scores(token_level_rewards, response_mask)
    gid = _group_ids(index, scores.shape[0], scores.device)
    adv = torch.zeros_like(scores)
    for g in range(int(gid.max()) + 1 if gid.numel() else 0):
        rows = (gid == g).nonzero().squeeze(-1)
        if len(rows) < 2:
            raise ValueError(
                f"grpo_passk needs at least 2 samples per prompt group; group "
                f"{list(index)[int(rows[0])]!r} has 1 (set rollout.n >= 2)"
            )
        group = scores[rows]
        top, top_idx = torch.topk(group, 2)
        a = top[0] - top[1]
        if norm_by_std:
            a = a / (group.std() + epsilon)
        adv[rows[top_idx[0]]] = a
    return _broadcast(adv, response_mask)


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
) -> AdvOut:
    """REINFORCE++-baseline: the group mean as baseline, then whitened over the batch.

    A_i = s_i - mean of its group (a group of one: 0), broadcast over tokens x mask, then
    whiten(A) over every masked token of the batch, x mask; returns = advantages.
    (``epsilon`` is unused, as in verl.)
    """
    scores = _scores(token_level_rewards, response_mask)
    n, mean, _ = _group_stats(scores, index)
    adv = scores - torch.where(n < 2, 0.0, mean)
    keep = response_mask.bool()
    tiled = torch.where(keep, adv[:, None], 0.0)
    advantages = torch.where(keep, masked_whiten(tiled, keep), 0.0)
    return advantages, advantages


@ADV_ESTIMATORS.register("opo")
@torch.no_grad()
def opo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
) -> AdvOut:
    """OPO (Hao et al. 2025): the length-weighted group mean as baseline.

    b = sum_j |y_j| s_j / sum_j |y_j| over the group (a group of one: 0); A_i = s_i - b,
    broadcast over tokens x mask; returns = advantages. (``epsilon`` is unused, as in verl.)
    """
    scores = _scores(token_level_rewards, response_mask)
    lengths = response_mask.sum(-1).to(scores.dtype)
    gid = _group_ids(index, scores.shape[0], scores.device)
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    weighted = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, gid, lengths * scores)
    total_len = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, gid, lengths)
    count = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, gid, torch.ones_like(scores))
    baseline = torch.where(count > 1, weighted / total_len.clamp(min=1e-30), 0.0)[gid]
    return _broadcast(scores - baseline, response_mask)


@ADV_ESTIMATORS.register("gpg")
@torch.no_grad()
def gpg(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
) -> AdvOut:
    """GPG (Chu et al. 2025): group-mean baseline scaled up by the share of zero scores.

    alpha = B / max(#samples with a nonzero score, 1) over the whole batch of B samples
    (verl 0.9 computes it so and ignores the ``alpha`` argument; so does this);
    A_i = alpha (s_i - mean of its group) / f_norm (a group of one: mean 0), broadcast over
    tokens x mask; returns = advantages. (``epsilon`` is unused, as in verl.)
    """
    scores = _scores(token_level_rewards, response_mask)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    n, mean, _ = _group_stats(scores, index)
    adv = alpha * (scores - torch.where(n < 2, 0.0, mean)) / f_norm
    return _broadcast(adv, response_mask)
