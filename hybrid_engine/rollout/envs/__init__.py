"""Environments for multi-turn rollouts: the interface and registry (`base`), feedback and
retry (`feedback`), tools (`tools`, run by `tool_runner`)."""

from hybrid_engine.registry import ENVIRONMENTS
from hybrid_engine.rollout.envs.base import (
    Environment,
    Messages,
    Step,
    environment_class,
    make_environment,
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
