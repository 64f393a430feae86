"""verifiers environments defined for the tests (`data.train_source: verifiers:vf_envs:<name>`):
one single-turn with a rubric, one multi-turn. Rewards depend on the text, so a random
model gets a signal."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

QUESTIONS = [
    {"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(6) for b in range(6)
]


def _text(message) -> str:
    content = message["content"] if isinstance(message, dict) else message.content
    return content or ""


def answer_length(completion, **_) -> float:
    """The assistant's characters over 40, at most 1."""
    chars = sum(
        len(_text(m))
        for m in completion
        if (m["role"] if isinstance(m, dict) else m.role) == "assistant"
    )
    return min(chars / 40, 1.0)


def mentions_answer(completion, answer, **_) -> float:
    return float(any(answer in _text(m) for m in completion))


def single_turn(system_prompt: str = "Answer with a number.") -> vf.Environment:
    rubric = vf.Rubric(funcs=[answer_length, mentions_answer], weights=[1.0, 0.0])
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(QUESTIONS[:24]),
        eval_dataset=Dataset.from_list(QUESTIONS[24:]),
        system_prompt=system_prompt,
        rubric=rubric,
    )


class AskAgain(vf.MultiTurnEnv):
    """After each answer the user asks again, up to max_turns assistant turns."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Are you sure? Answer again.")]


def turns(state, **_) -> float:
    return float(len(state["trajectory"]))


def multi_turn() -> vf.Environment:
    rubric = vf.Rubric(funcs=[answer_length, turns], weights=[1.0, 0.0])
    return AskAgain(dataset=Dataset.from_list(QUESTIONS), rubric=rubric, max_turns=2)
