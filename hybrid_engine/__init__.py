"""hybridrl's engine: config, batch container, algorithms, models, rollout, rewards, roles.

It knows nothing of Prefect, storage backends or tracking; a plain Python loop drives it.
"""

import os

# Ray reads these when it is first imported (before the pool module runs): no token auth on
# a local head, and a head on 127.0.0.1 is reached on 127.0.0.1, not the host's address.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
for _key, _value in RAY_ENV.items():
    os.environ.setdefault(_key, _value)

from hybrid_engine.batch import Batch  # noqa: E402
from hybrid_engine.config import ConfigError, HybridConfig, load_config  # noqa: E402

__all__ = ["Batch", "ConfigError", "HybridConfig", "load_config"]
