"""hybridrl's engine: config, batch container, algorithms, models, rollout, rewards, roles.

It knows nothing of Prefect, storage backends or tracking; a plain Python loop drives it.
"""

import os

# Ray reads these when it is first imported (before the pool module runs), as defaults only
# (a user's RAY_AUTH_MODE=token is kept, by the driver and the local head it starts): no token
# auth on a local head, and a head on 127.0.0.1 is reached on 127.0.0.1, not the host address.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
for _key, _value in RAY_ENV.items():
    os.environ.setdefault(_key, _value)

# A training step's four stages, in their order: the pipeline's tasks, the stage state's
# directories (steps/<N>/<stage>) and every listing of stages come from this constant.
STAGES = ("rollout", "reward", "advantage", "update")

__all__ = ["STAGES", "Batch", "ConfigError", "HybridConfig", "load_config"]


def __getattr__(name: str) -> object:
    """The package's names, imported on first use: a process that needs one light module
    (the tool runner's child imports `hybrid_engine.rollout.envs.builtin_tools`) does not load torch."""
    if name == "Batch":
        from hybrid_engine.batch import Batch

        return Batch
    if name in ("ConfigError", "HybridConfig", "load_config"):
        from hybrid_engine import config

        return getattr(config, name)
    raise AttributeError(f"module 'hybrid_engine' has no attribute {name!r}")
