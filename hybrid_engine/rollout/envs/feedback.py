"""Feedback and retry: answer, hear whether it was right (and which way it was off), retry.

Turn k's answer is scored like a single-turn response (the built-in scorer: reasoning-gym's
own, or the numeric match). Right: reward `turn_discount ** (k - 1)`, done. Wrong: reward 0
and a user message saying so (with `hint`, whether the answer was too high or too low), and
the conversation goes on until `rollout.multi_turn.max_turns`.
"""

from __future__ import annotations

import math
from typing import Any

from hybrid_engine.registry import ENVIRONMENTS
from hybrid_engine.rewards import builtin_score, extract_answer
from hybrid_engine.rollout.envs.base import Environment, Messages, Step

RETRY = "Try again, and end with the final answer as a plain number."


def direction(answer: str | None, truth: Any) -> str | None:
    """'too high' / 'too low' for a numeric answer and ground truth, else None."""
    try:
        a, t = float(answer), float(str(truth).replace(",", ""))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if math.isclose(a, t):
        return None
    return "too high" if a > t else "too low"


@ENVIRONMENTS.register("feedback")
class FeedbackEnv(Environment):
    """Feedback and retry: a wrong answer hears so (too high / too low) and tries again."""

    def __init__(
        self,
        hint: bool = True,
        turn_discount: float = 1.0,
        answer_format: str = "last_number",
        task_config: dict[str, Any] | None = None,
    ) -> None:
        if not 0 < turn_discount <= 1:
            raise ValueError(f"feedback: turn_discount={turn_discount} must be in (0, 1]")
        self.hint, self.turn_discount = hint, turn_discount
        self.answer_format, self.task_config = answer_format, task_config or {}
        self.row: dict[str, Any] = {}
        self.turn = 0

    def reset(self, row: dict[str, Any], seed: int) -> Messages:
        self.row, self.turn = row, 0
        return [dict(m) for m in row["prompt"]]

    def step(self, assistant_text: str) -> Step:
        self.turn += 1
        score = builtin_score(assistant_text, self.row, self.answer_format, self.task_config)
        if score >= 1.0:
            return Step(None, self.turn_discount ** (self.turn - 1), True, {"success": True})
        answer = extract_answer(assistant_text, self.answer_format)
        if answer is None:
            text = f"I found no number at the end of your answer. {RETRY}"
        else:
            off = direction(answer, self.row["ground_truth"]) if self.hint else None
            text = f"{answer} is wrong" + (f": it is {off}. " if off else ". ") + RETRY
        return Step([{"role": "user", "content": text}], 0.0, False, {"success": False})
