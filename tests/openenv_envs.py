"""OpenEnv environments for the tests, written against OpenEnv's own server classes; served by
the test with OpenEnv's `create_app` (`python tests/openenv_envs.py PORT KIND`) or in-process
by hybridrl (`openenv:openenv_envs.Retry`)."""

from __future__ import annotations

import sys
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class Say(Action):
    message: str = Field(..., description="what the policy wrote")


class Heard(Observation):
    feedback: str = ""


class Retry(Environment):
    """Two turns: after the first answer it asks for a longer one; the reward is the second
    answer's length over 100 (at most 1), set at the last turn."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **_: Any) -> Heard:
        self._state = State(step_count=0)
        return Heard(feedback=f"Episode seeded {seed}.", done=False, reward=None)

    def step(self, action: Say, **_: Any) -> Heard:
        self._state.step_count += 1
        if self._state.step_count == 1:
            return Heard(feedback="Longer, please.", done=False, reward=None)
        return Heard(feedback="", done=True, reward=min(len(action.message) / 100, 1.0))

    @property
    def state(self) -> State:
        return self._state


class Unhurried(Retry):
    """Retry under a name no other test serves (the start-up timeout's test starts it)."""


class Edit(Action):
    path: str = "answer.txt"
    text: str = ""


class TwoFields(Retry):
    """An action with two text fields: which holds the policy's text must be named."""

    def step(self, action: Edit, **_: Any) -> Heard:
        return super().step(Say(message=action.text))


def make_mcp():
    from fastmcp import FastMCP

    mcp = FastMCP("calc")

    @mcp.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    return mcp


class Calc(MCPEnvironment):
    """An MCP environment with one tool, `add`."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__(make_mcp())
        self._state = State(step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **_: Any
    ) -> Observation:
        self._state = State(step_count=0)
        return Observation(done=False, reward=None)

    def _step_impl(self, action: Action, **_: Any) -> Observation:
        return Observation(done=False, reward=None)

    @property
    def state(self) -> State:
        return self._state


if __name__ == "__main__":
    import uvicorn
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    port, kind = int(sys.argv[1]), sys.argv[2]
    if kind == "retry":
        app = create_app(Retry, Say, Heard, env_name="retry", max_concurrent_envs=64)
    else:
        app = create_app(
            Calc, CallToolAction, CallToolObservation, env_name="calc", max_concurrent_envs=64
        )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
