"""Agent programs to start from: plain `openai` client code, nothing of hybridrl imported.
Copy one into your own module and name it in `rollout.agent.function`."""

from __future__ import annotations

import openai

CHECK = "Check your answer once. Then give the final answer as a plain number."


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
