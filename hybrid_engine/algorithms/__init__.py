"""RL algorithm pieces as pure tensor functions: advantage estimators (``advantages``),
policy/value losses, KL penalties and entropy (``losses``), masked statistics (``utils``)."""

from hybrid_engine.algorithms.advantages import (
    ADV_ESTIMATORS,
    get_adv_estimator,
    register_adv_estimator,
)

__all__ = ["ADV_ESTIMATORS", "get_adv_estimator", "register_adv_estimator"]
