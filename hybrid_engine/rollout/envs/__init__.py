"""Environments for multi-turn rollouts: the interface and registry (`base`), feedback and
retry (`feedback`), tools (`tools`, run by `tool_runner`), OpenEnv servers (`openenv_env`)."""

from typing import Any

from hybrid_engine.registry import ENVIRONMENTS
from hybrid_engine.rollout.envs.base import (
    Environment,
    Messages,
    Step,
    environment_class,
    register_environment,
)
from hybrid_engine.rollout.envs.feedback import FeedbackEnv
from hybrid_engine.rollout.envs.tools import CalculatorEnv, ToolEnvironment

__all__ = [
    "ENVIRONMENTS",
    "CalculatorEnv",
    "Environment",
    "FeedbackEnv",
    "Messages",
    "Step",
    "ToolEnvironment",
    "environment_class",
    "make_environment",
    "register_environment",
]


def make_environment(spec: str, kwargs: dict[str, Any]) -> Environment:
    """A new environment (one per trajectory): a registered name, `module:Class`, or
    `openenv:<server URL or module.Class>`, a session with an OpenEnv server (the [openenv]
    extra)."""
    if spec.startswith("openenv:"):
        from hybrid_engine.rollout.envs.openenv_env import OpenEnvEnvironment

        return OpenEnvEnvironment(spec.removeprefix("openenv:"), **kwargs)
    try:
        return environment_class(spec)(**kwargs)
    except TypeError as e:
        raise ValueError(
            f"rollout.multi_turn.env_kwargs={kwargs!r} rejected by environment {spec!r}: {e}"
        ) from None
