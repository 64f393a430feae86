"""OpenEnv environments in multi-turn rollouts (the `[openenv]` extra), through OpenEnv's own
client: one `GenericEnvClient` session per trajectory.

    rollout.multi_turn.environment: openenv:http://127.0.0.1:8000   a running OpenEnv server
    rollout.multi_turn.environment: openenv:my_pkg.envs.MyEnvironment
        an OpenEnv `Environment` class, served here with OpenEnv's `create_app` on 127.0.0.1
        (once per process; its action and observation classes from `step`'s annotations)

What the policy writes becomes the action the server's `/schema` describes:
- an MCP environment (actions `call_tool` / `list_tools`): its tools are listed at reset and
  given to the chat template; each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  in a turn is one `call_tool` step, its result a `tool` message; a turn without a tool call
  ends the trajectory (the final answer, scored by the reward stage unless the server gave a
  reward);
- otherwise the action's one string field (`env_kwargs: {action_field: name}` where there are
  several) holds the turn's text.
The observation's fields other than done, reward and metadata are the next user message (the
field's text where there is one, else JSON). The server's reward and done are the turn's.
`reset` passes `seed`; the row's prompt opens the conversation, the reset observation follows.
"""

from __future__ import annotations

import importlib
import json
import threading
import time
import typing
from typing import Any

from hybrid_engine.rollout.envs.base import Environment, Messages, Step
from hybrid_engine.rollout.envs.tools import parse_tool_calls

PREFIX = "openenv:"
_SERVED: dict[str, str] = {}  # class path -> URL of the server this process started
_LOCK = threading.Lock()
HIDDEN = {"done", "reward", "metadata"}


def serve_class(path: str, timeout_s: float = 60.0) -> str:
    """The URL of an OpenEnv server for the `Environment` class `path` (started on first use,
    in a thread of this process, on a free port of 127.0.0.1, within `timeout_s`)."""
    with _LOCK:
        if path in _SERVED:
            return _SERVED[path]
        import socket

        import uvicorn
        from openenv.core.env_server.http_server import create_app

        module, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"rollout.multi_turn.environment={PREFIX}{path}: {e}") from None
        hints = typing.get_type_hints(cls.step)
        action_cls, obs_cls = hints.get("action"), hints.get("return")
        if action_cls is None or obs_cls is None:
            raise ValueError(
                f"{PREFIX}{path}: annotate step(self, action: MyAction) -> MyObservation"
            )
        app = create_app(cls, action_cls, obs_cls, max_concurrent_envs=1024)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="openenv", daemon=True
        )
        thread.start()
        deadline = time.monotonic() + timeout_s
        # the deadline is read before `started`, so a start first seen late counts as late
        while not (time.monotonic() < deadline and server.started):
            if not thread.is_alive():
                raise RuntimeError(
                    f"{PREFIX}{path}: the in-process OpenEnv server stopped before it started "
                    "(its log says why)"
                )
            if time.monotonic() >= deadline:
                server.should_exit = True  # a late start shuts down at once
                raise TimeoutError(
                    f"{PREFIX}{path}: the in-process OpenEnv server did not start within "
                    f"{timeout_s:g} s (rollout.multi_turn.env_kwargs.timeout_s)"
                )
            time.sleep(0.01)
        _SERVED[path] = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return _SERVED[path]


def observation_text(obs: dict[str, Any]) -> str:
    shown = {k: v for k, v in obs.items() if k not in HIDDEN and v not in (None, "", [], {})}
    if len(shown) == 1 and isinstance(next(iter(shown.values())), str):
        return next(iter(shown.values()))
    return json.dumps(shown, default=str) if shown else ""


def tool_text(obs: dict[str, Any]) -> str:
    """A `call_tool` observation as a tool message: the error's message, the result's text
    parts, or the result as JSON."""
    if error := obs.get("error"):
        return f"error: {error.get('message', error)}" if isinstance(error, dict) else str(error)
    result = obs.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        texts = [p.get("text", "") for p in result["content"] if isinstance(p, dict)]
        return "\n".join(texts)
    return result if isinstance(result, str) else json.dumps(result, default=str)


class OpenEnvEnvironment(Environment):
    """One trajectory's session with an OpenEnv server."""

    def __init__(self, target: str, action_field: str | None = None, timeout_s: float = 60.0):
        import httpx
        from openenv.core import GenericEnvClient

        url = target if "://" in target else serve_class(target, timeout_s)
        self.name = f"{PREFIX}{target}"
        try:
            schema = httpx.get(f"{url}/schema", timeout=timeout_s).json()["action"]
        except httpx.TimeoutException:
            raise TimeoutError(
                f"{self.name}: the OpenEnv server at {url} did not answer within {timeout_s:g} s "
                "(rollout.multi_turn.env_kwargs.timeout_s)"
            ) from None
        text = json.dumps(schema)
        self.mcp = "call_tool" in text and "tool_name" in text
        self.field = action_field
        props = schema.get("properties", {})
        if not self.mcp and self.field is not None and self.field not in props:
            raise ValueError(
                f"{self.name}: rollout.multi_turn.env_kwargs.action_field={self.field!r} is not "
                f"a field of the action ({', '.join(props)})"
            )
        if not self.mcp and self.field is None:
            strings = [
                k for k in schema.get("required", props) if props.get(k, {}).get("type") == "string"
            ]
            if len(strings) != 1:
                raise ValueError(
                    f"{self.name}: the action has string fields {strings}; name the one that "
                    "holds the policy's text with rollout.multi_turn.env_kwargs.action_field"
                )
            self.field = strings[0]
        self.client = GenericEnvClient(base_url=url, message_timeout_s=timeout_s).sync()
        self.client.connect()
        self.template_tools: list[dict[str, Any]] | None = None

    def __repr__(self) -> str:
        return self.name

    def reset(self, row: dict[str, Any], seed: int) -> Messages:
        result = self.client.reset(seed=seed)
        messages = [dict(m) for m in row["prompt"]]
        if self.mcp:
            listed = self.client.step({"type": "list_tools"}).observation
            self.template_tools = [
                {
                    "type": "function",
                    "function": {
                        "name": t["name"],
                        "description": t.get("description", ""),
                        "parameters": t.get("input_schema") or {"type": "object"},
                    },
                }
                for t in listed.get("tools", [])
            ]
        if shown := observation_text(result.observation):
            messages.append({"role": "user", "content": shown})
        return messages

    def step(self, assistant_text: str) -> Step:
        if not self.mcp:
            result = self.client.step({self.field: assistant_text})
            shown = observation_text(result.observation)
            obs = None if result.done or not shown else [{"role": "user", "content": shown}]
            return Step(obs, result.reward, bool(result.done), {})
        calls = parse_tool_calls(assistant_text)
        if not calls:  # a final answer
            return Step(None, None, True, {"tool_calls": 0})
        obs, reward, done, errors = [], None, False, 0
        for call in calls:
            if isinstance(call, str):  # not valid JSON: the error is the observation
                obs.append({"role": "tool", "content": call})
                errors += 1
                continue
            name, arguments = call
            result = self.client.step(
                {"type": "call_tool", "tool_name": name, "arguments": arguments}
            )
            o = result.observation
            errors += o.get("error") is not None
            obs.append({"role": "tool", "content": tool_text(o)})
            reward, done = result.reward, done or bool(result.done)
        info = {"tool_calls": len(calls), "tool_errors": errors}
        return Step(None if done else obs, reward, done, info)

    def close(self) -> None:
        self.client.close()
