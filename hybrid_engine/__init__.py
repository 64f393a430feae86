"""hybridrl's engine: config, batch container, algorithms, models, rollout, rewards, roles.

It knows nothing of Prefect, storage backends or tracking; a plain Python loop drives it.
"""

from hybrid_engine.batch import Batch
from hybrid_engine.config import ConfigError, HybridConfig, load_config

__all__ = ["Batch", "ConfigError", "HybridConfig", "load_config"]
