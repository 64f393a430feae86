"""RL algorithm pieces as pure tensor functions: advantage estimators (``advantages``),
policy and value losses and the entropy reference (``losses``), KL penalties (``kl``),
train/rollout mismatch correction (``correction``), masked statistics (``utils``).

The two registries, ``ADV_ESTIMATORS`` and ``POLICY_LOSSES``, are the one source of the names
the config accepts, of what the engine builds for an estimator, and of the README's lists."""

from hybrid_engine.algorithms.advantages import (
    ADV_ESTIMATORS,
    estimator_needs,
    get_adv_estimator,
    register_adv_estimator,
)
from hybrid_engine.algorithms.losses import (
    POLICY_LOSSES,
    get_policy_loss,
    loss_aggregation,
    register_policy_loss,
)

__all__ = [
    "ADV_ESTIMATORS",
    "POLICY_LOSSES",
    "estimator_needs",
    "get_adv_estimator",
    "get_policy_loss",
    "loss_aggregation",
    "register_adv_estimator",
    "register_policy_loss",
]
