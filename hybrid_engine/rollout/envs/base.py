"""The environment interface and its registry.

An environment holds one conversation. The multi-turn rollout (`hybrid_engine.rollout.multiturn`)
makes one per trajectory and calls

    messages = env.reset(row, seed)          # the first observation: the prompt's messages
    obs, reward, done, info = env.step(text)  # after each assistant turn, its decoded text

`row` is the prompt's sample: `prompt` (chat messages), `data_source`, `ground_truth`,
`extra_info`, `uid`. `obs` is a list of messages (role `user` or `tool`) or None; `reward`
a float or None (the rollout keeps the last one given; see `rollout.multi_turn`);
`info` may say `success` (bool: counted by validation and `acc`), `tool_calls` and
`tool_errors` (ints, summed over the turns). Plain Python, synchronous; everything random
must come from `seed`, so a trajectory is a pure function of (row, seed, the policy's text).

An environment is named by a registered name (`@ENVIRONMENTS.register("name")`), by
`module:Class`, or by `openenv:<server URL or module.Class>` (`openenv_env`); its constructor
takes `rollout.multi_turn.env_kwargs`. One with a `close()` is closed after its trajectory.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hybrid_engine.registry import ENVIRONMENTS
from hybrid_engine.specs import load_spec

Messages = list[dict[str, Any]]


class Step(NamedTuple):
    observation: Messages | None
    reward: float | None
    done: bool
    info: dict[str, Any]


class Environment:
    """Base class: subclasses implement `reset` and `step`."""

    def reset(self, row: dict[str, Any], seed: int) -> Messages:
        raise NotImplementedError

    def step(self, assistant_text: str) -> Step:
        raise NotImplementedError


register_environment = ENVIRONMENTS.register  # the plugin spelling


def environment_class(spec: str) -> type[Environment]:
    """The class a registered name or a `module:Class` spec names."""
    if ":" not in spec:
        return ENVIRONMENTS[spec]
    cls = load_spec(spec, "rollout.multi_turn.environment", "Class")
    if not (isinstance(cls, type) and callable(getattr(cls, "step", None))):
        raise ValueError(f"environment {spec!r} is not a class with reset and step")
    return cls
