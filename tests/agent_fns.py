"""Agent functions the tests train and roll out with (`rollout.agent.function:
agent_fns:<name>`): plain programs written against the `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
import time

import openai


async def answer_then_revise(client: openai.AsyncOpenAI, row: dict, **_: object) -> None:
    """Answer, then check the answer and revise it once: two calls, the second extending
    the first. Returns None: the reward stage scores the final answer."""
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "Check your answer. Reply with the final number only."},
    ]
    await client.chat.completions.create(model="policy", messages=messages)


def answer_sync(client: openai.OpenAI, row: dict, scale: float = 1.0) -> dict:
    """One call with the plain client; the reward is the answer's length, scaled."""
    out = client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=6)
    text = out.choices[0].message.content or ""
    return {
        "reward": scale * len(text) / 100,
        "info": {"success": len(text) > 10, "chars": len(text)},
    }


async def rewrite_history(client: openai.AsyncOpenAI, row: dict) -> float:
    """Two calls, the second from a rewritten history (the first answer summarised): a split."""
    first = await client.chat.completions.create(model="m", messages=row["prompt"])
    summary = (first.choices[0].message.content or "")[:5]
    await client.chat.completions.create(
        model="m",
        messages=[
            *row["prompt"],
            {"role": "assistant", "content": summary},
            {"role": "user", "content": "Again."},
        ],
    )
    return 0.5


async def raises(client: openai.AsyncOpenAI, row: dict) -> float:
    await client.chat.completions.create(model="m", messages=row["prompt"])
    raise RuntimeError("the agent broke")


async def hangs(client: openai.AsyncOpenAI, row: dict) -> float:
    await client.chat.completions.create(model="m", messages=row["prompt"])
    await asyncio.sleep(3600)
    return 1.0


def hangs_sync(client: openai.OpenAI, row: dict) -> float:
    client.chat.completions.create(model="m", messages=row["prompt"])
    time.sleep(3600)
    return 1.0


async def junk(client: openai.AsyncOpenAI, row: dict) -> str:
    await client.chat.completions.create(model="m", messages=row["prompt"])
    return "a string is not a reward"


async def unknown_tool(client: openai.AsyncOpenAI, row: dict) -> float:
    """Sends a history with a call to a tool the request does not offer; catches the error."""
    await client.chat.completions.create(model="m", messages=row["prompt"])
    call = {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}
    with contextlib.suppress(openai.BadRequestError):  # the agent goes on
        await client.chat.completions.create(
            model="m",
            messages=[
                *row["prompt"],
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
        )
    return 1.0


async def malformed(client: openai.AsyncOpenAI, row: dict) -> float:
    await client.chat.completions.create(model="m", messages=[{"role": "narrator", "content": "x"}])
    return 1.0


async def no_call(client: openai.AsyncOpenAI, row: dict) -> float:
    return 1.0


async def probe(client: openai.AsyncOpenAI, row: dict) -> dict:
    """One call with n, logprobs, stop, temperature and max_tokens; reports what came back."""
    models = await client.models.list()
    out = await client.chat.completions.create(
        model="whatever",
        messages=row["prompt"],
        n=3,
        logprobs=True,
        temperature=0.7,
        max_completion_tokens=5,
    )
    return {
        "reward": 1.0,
        "info": {
            "models": len(models.data),
            "choices": len(out.choices),
            "completion_tokens": out.usage.completion_tokens,
            "logprob_tokens": sum(len(c.logprobs.content) for c in out.choices),
            "longest": max(len(c.logprobs.content) for c in out.choices),
        },
    }


async def picky(client: openai.AsyncOpenAI, row: dict) -> float:
    """One call; raises when the answer has an odd number of characters (a data-dependent
    share of faults)."""
    out = await client.chat.completions.create(model="m", messages=row["prompt"])
    text = out.choices[0].message.content or ""
    if len(text) % 2:
        raise ValueError("odd")
    return len(text) / 50


def _typed(kind: str) -> object:
    import math

    import numpy as np
    import torch

    return {
        "float32": np.float32(0.1),
        "int64": np.int64(2),
        "bool_": np.bool_(True),
        "tensor": torch.tensor(0.75),
        "bool": False,
        "inf": -math.inf,
        "float32_nan": np.float32("nan"),
        "tensor_2": torch.tensor([1.0, 2.0]),
    }[kind]


async def typed_reward(
    client: openai.AsyncOpenAI, row: dict, kinds: list[str], wrap: bool
) -> object:
    """One call; returns the reward `_typed` makes of the kind for the row's prompt (k-th
    prompt of the batch: kinds[k]), in a dict with `wrap`."""
    await client.chat.completions.create(model="m", messages=row["prompt"], max_tokens=2)
    reward = _typed(kinds[int(row["uid"].split("-")[1])])
    return {"reward": reward} if wrap else reward


FINALS: dict[str, str] = {}  # uid -> the final answer `split_then_none` got (validation)


async def split_then_none(client: openai.AsyncOpenAI, row: dict) -> None:
    """Two calls, the second from a rewritten history (a split); returns None, so the reward
    stage scores the final answer: the second call's."""
    first = await client.chat.completions.create(model="m", messages=row["prompt"])
    summary = (first.choices[0].message.content or "")[:3]
    second = await client.chat.completions.create(
        model="m",
        messages=[
            *row["prompt"],
            {"role": "assistant", "content": summary},
            {"role": "user", "content": "Again, longer."},
        ],
    )
    FINALS[row["uid"]] = second.choices[0].message.content or ""


STATUSES: list[int] = []  # the HTTP status each `template_boom` episode got


async def template_boom(client: openai.AsyncOpenAI, row: dict) -> float:
    """A call whose message the chat template refuses (it raises on "BOOM"); catches the
    error, then makes a good call."""
    try:
        await client.chat.completions.create(
            model="m", messages=[*row["prompt"], {"role": "user", "content": "BOOM"}]
        )
    except openai.APIStatusError as e:
        STATUSES.append(e.status_code)
    await client.chat.completions.create(model="m", messages=row["prompt"])
    return 1.0


ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


async def offers_tool(client: openai.AsyncOpenAI, row: dict) -> float:
    """One call that offers a tool (so the completion is parsed for tool calls)."""
    await client.chat.completions.create(model="m", messages=row["prompt"], tools=[ADD])
    return 1.0


def _first_of_group(row: dict) -> bool:
    return row["uid"].endswith("-0")


async def blocks_loop(client: openai.AsyncOpenAI, row: dict) -> float:
    """One call; then, on the rows of the first prompt of each batch, blocks the event loop
    (time.sleep in async code) for 20 s."""
    await client.chat.completions.create(model="m", messages=row["prompt"], max_tokens=2)
    if _first_of_group(row):
        time.sleep(20)
    return 1.0


async def exits(client: openai.AsyncOpenAI, row: dict) -> float:
    """One call; then SystemExit on the rows of the first prompt of each batch."""
    await client.chat.completions.create(model="m", messages=row["prompt"], max_tokens=2)
    if _first_of_group(row):
        raise SystemExit(3)
    return 1.0


def exits_sync(client: openai.OpenAI, row: dict) -> float:
    client.chat.completions.create(model="m", messages=row["prompt"], max_tokens=2)
    if _first_of_group(row):
        raise SystemExit(3)
    return 1.0


async def own_temperature(client: openai.AsyncOpenAI, row: dict) -> float:
    """Answer at temperature 0.5, then check the answer greedily (temperature 0): two calls
    of one sequence, neither at the rollout's temperature."""
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="m", messages=messages, temperature=0.5)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "Check it."},
    ]
    await client.chat.completions.create(model="m", messages=messages, temperature=0)
    return float(len(first.choices[0].message.content or "") % 3)


SAMPLING_ERRORS: list[str] = []  # the error codes `own_top_p` got


async def own_top_p(client: openai.AsyncOpenAI, row: dict) -> float:
    """A call at the rollout's top_p (1.0) is served; one with its own top_p or top_k is
    refused (the update could not train on the distribution it sampled from)."""
    await client.chat.completions.create(model="m", messages=row["prompt"], top_p=1.0)
    for extra in ({"top_p": 0.5}, {"extra_body": {"top_k": 5}}):
        try:
            await client.chat.completions.create(model="m", messages=row["prompt"], **extra)
        except openai.BadRequestError as e:
            SAMPLING_ERRORS.append(e.code)
    return 1.0


async def asks_too_much(client: openai.AsyncOpenAI, row: dict) -> dict:
    """One call asking for far more tokens than rollout.max_new_tokens."""
    out = await client.chat.completions.create(
        model="m", messages=row["prompt"], max_tokens=1000, logprobs=True
    )
    choice = out.choices[0]
    return {
        "reward": 1.0,
        "info": {"tokens": len(choice.logprobs.content), "used": out.usage.completion_tokens},
    }
