"""Tools as an environment: the policy calls functions, reads their output, then answers.

A tool is a plain function (`module:function`) with type hints and a Google-style docstring;
its JSON schema is transformers' `get_json_schema`. How the tools reach the prompt:

- `protocol: template`: the model's chat template renders them (`apply_chat_template(...,
  tools=...)`) and tool outputs return as `tool` messages;
- `protocol: text` (for templates that ignore tools, SmolLM2's among them): the system
  message describes them, a call is the tagged block

      <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>

  and the outputs return in one `user` message of `<tool_response>` blocks.

`protocol: auto` (the default) picks `template` when the template renders a tool's schema.
A turn with tool calls gets their outputs back (no reward); a turn without one is the final
answer, scored like a single-turn response (reward 1 or 0, done). A call that is not valid
JSON, names an unknown tool, raises, or runs past `timeout_s` (`tool_runner`) returns its
error as the observation, and counts in `info["tool_errors"]`.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from transformers.utils import get_json_schema

from hybrid_engine.registry import ENVIRONMENTS
from hybrid_engine.rewards import builtin_score
from hybrid_engine.rollout.envs.base import Environment, Messages, Step
from hybrid_engine.rollout.envs.tool_runner import load_tool, runner

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

TEXT_PROTOCOL = """You can call tools. To call one, write exactly
<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call>
and stop: its result comes back in a <tool_response> message. The tools, as JSON schemas:
{schemas}"""


@lru_cache(maxsize=8)
def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template puts a tool's schema into the prompt."""
    probe = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(
            probe, tools=[get_json_schema(zq_probe_tool)], tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that cannot take tools does not render them
        return False
    return "zq_probe_tool" in text


def zq_probe_tool(x: int) -> int:
    """Probe.

    Args:
        x: a number
    """
    return x


@lru_cache(maxsize=64)
def tool_schema(spec: str) -> dict[str, Any]:
    """The JSON schema of tool `module:function` (one environment per trajectory: cached)."""
    return get_json_schema(load_tool(spec))


def parse_tool_calls(text: str) -> list[tuple[str, dict[str, Any]] | str]:
    """Per `<tool_call>` block of `text`: (name, arguments), or an error message."""
    calls: list[tuple[str, dict[str, Any]] | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(f"error: the tool call is not valid JSON ({e.msg})")
            continue
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('error: a tool call needs {"name": ..., "arguments": {...}}')
        elif not isinstance(args, dict):
            calls.append("error: the tool call's arguments must be a JSON object")
        else:
            calls.append((call["name"], args))
    return calls


@ENVIRONMENTS.register("tools")
class ToolEnvironment(Environment):
    """Tools (`env_kwargs.tools`: `module:function`s) called from the policy's turns, then
    a final answer scored like a single-turn response."""

    def __init__(
        self,
        tools: list[str],
        protocol: str = "auto",
        example: str | None = None,
        timeout_s: float = 5.0,
        max_output_chars: int = 2000,
        max_calls_per_turn: int = 4,
        answer_format: str = "last_number",
        task_config: dict[str, Any] | None = None,
    ) -> None:
        if protocol not in ("auto", "template", "text"):
            raise ValueError(f"tools: protocol={protocol!r} must be auto, template or text")
        self.specs = {load_tool(spec).__name__: spec for spec in tools}
        self.schemas = [tool_schema(spec) for spec in tools]
        self.protocol, self.example = protocol, example
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars
        self.max_calls_per_turn = max_calls_per_turn
        self.answer_format, self.task_config = answer_format, task_config or {}
        self.row: dict[str, Any] = {}

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Resolve `protocol: auto` against the tokenizer's chat template (before `reset`)."""
        if self.protocol == "auto":
            self.protocol = "template" if template_renders_tools(tokenizer) else "text"

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The schemas to give `apply_chat_template(tools=...)`, in the template protocol."""
        return self.schemas if self.protocol == "template" else None

    def reset(self, row: dict[str, Any], seed: int) -> Messages:
        self.row = row
        messages = [dict(m) for m in row["prompt"]]
        if self.protocol == "template":
            return messages
        text = TEXT_PROTOCOL.format(schemas="\n".join(json.dumps(s) for s in self.schemas))
        if self.example:
            text += f"\nExample: {self.example}"
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        else:
            messages.insert(0, {"role": "system", "content": text})
        return messages

    def step(self, assistant_text: str) -> Step:
        calls = parse_tool_calls(assistant_text)
        if not calls:
            score = builtin_score(assistant_text, self.row, self.answer_format, self.task_config)
            return Step(None, score, True, {"success": score >= 1.0, "tool_calls": 0})
        outputs, errors = [], 0
        for k, call in enumerate(calls):
            if k >= self.max_calls_per_turn:
                out, failed = f"error: at most {self.max_calls_per_turn} calls per turn", True
            elif isinstance(call, str):
                out, failed = call, True
            elif call[0] not in self.specs:
                out, failed = f"error: no tool named {call[0]!r} ({', '.join(self.specs)})", True
            else:
                out, failed = runner().call(
                    self.specs[call[0]], call[1], self.timeout_s, self.max_output_chars
                )
            outputs.append(out)
            errors += failed
        if self.protocol == "template":
            obs = [{"role": "tool", "content": out} for out in outputs]
        else:
            blocks = "\n".join(f"<tool_response>\n{out}\n</tool_response>" for out in outputs)
            obs = [{"role": "user", "content": blocks}]
        return Step(obs, None, False, {"tool_calls": len(calls), "tool_errors": errors})


CALCULATOR_EXAMPLE = (
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>'
)


@ENVIRONMENTS.register("calculator")
class CalculatorEnv(ToolEnvironment):
    """`tools` with one tool, `hybrid_engine.rollout.envs.builtin_tools:calculator`, and an example call
    in the prompt."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("tools", ["hybrid_engine.rollout.envs.builtin_tools:calculator"])
        kwargs.setdefault("example", CALCULATOR_EXAMPLE)
        super().__init__(**kwargs)
