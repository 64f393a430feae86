"""Agent programs to start from: plain `openai` client code (the calculator is a
standard-library function). Copy one into your own module and name it in
`rollout.agent.function`; `calculator_demonstration` feeds `hybridrl warmstart`."""

from __future__ import annotations

import json
from typing import Any

import openai
from transformers.utils import get_json_schema

from hybrid_engine.rollout.envs.builtin_tools import calculator

CHECK = "Check your answer once. Then give the final answer as a plain number."

CALCULATOR = get_json_schema(calculator)
# SmolLM2's chat template ignores `tools`, so the system message says how to call one.
TOOL_PROMPT = (
    "You have a calculator. To use it, reply with only\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "<expression>"}}</tool_call>\n'
    "Its result comes back in the next message."
)


async def answer_then_check(client: openai.AsyncOpenAI, row: dict, check: str = CHECK) -> None:
    """Answer, then check the answer and revise it once (two calls, the second continuing the
    first). Returns None: the reward stage scores the final answer."""
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": check},
    ]
    await client.chat.completions.create(model="policy", messages=messages)


def with_calculator(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the calculator's instructions added to its system message."""
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{TOOL_PROMPT}"
    else:
        out.insert(0, {"role": "system", "content": TOOL_PROMPT})
    return out


def run_tool(arguments: str) -> str:
    """The calculator's output for a call's JSON arguments, or the error as text."""
    try:
        return calculator(**json.loads(arguments))
    except Exception as e:  # noqa: BLE001 - the model sees what went wrong
        return f"error: {type(e).__name__}: {e}"


async def calculator_agent(client: openai.AsyncOpenAI, row: dict, max_calls: int = 3) -> None:
    """Offer the calculator; run each tool call and send its result back, until a reply
    without a tool call (the final answer, scored by the reward stage) or `max_calls`."""
    messages = with_calculator(row["prompt"])
    for _ in range(max_calls):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR]
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return
        for call in message.tool_calls:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": run_tool(call.function.arguments),
                }
            )


def calculator_demonstration(row: dict) -> list[dict[str, Any]] | None:
    """What `calculator_agent` should do on a reasoning-gym arithmetic row: call the
    calculator on the question's expression, then answer with its result. None for a row
    without an expression."""
    entry = (row.get("extra_info") or {}).get("rg_entry") or {}
    expression = (entry.get("metadata") or {}).get("expression")
    if not expression:
        return None
    call = {"name": "calculator", "arguments": {"expression": expression}}
    result = calculator(expression)
    return [
        *with_calculator(row["prompt"]),
        {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]
