"""RL algorithm pieces as pure tensor functions: advantage estimators (``advantages``),
policy and value losses, loss aggregation and the entropy reference (``losses``), KL
estimators and controllers (``kl``), train/rollout mismatch correction (``correction``),
masked statistics (``utils``).

Each kind is registered by name in a registry of ``hybrid_engine.registry`` (the one source
of the names the config accepts, of what the engine builds for an estimator, and of the
reference docs). The plugin spellings stay importable from here."""

from hybrid_engine.algorithms.advantages import get_adv_estimator
from hybrid_engine.algorithms.losses import get_policy_loss, loss_aggregation, register_policy_loss
from hybrid_engine.registry import ADV_ESTIMATORS, POLICY_LOSSES, estimator_needs

register_adv_estimator = ADV_ESTIMATORS.register

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
