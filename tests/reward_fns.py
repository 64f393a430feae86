"""User reward functions for the tests (`reward.function: reward_fns:<name>`)."""

import math


def digit_share(prompts, completions, rows):
    """Share of digit characters: varies across random completions, so GRPO gets a signal."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def length_score(prompts, completions, rows):
    return [len(text) / 100 for text in completions]


def fails_on_x(prompts, completions, rows):
    if any(row["ground_truth"] == "x" for row in rows):
        raise ValueError("cannot score x")
    return [1.0 for _ in completions]


def always_raises(prompts, completions, rows):
    raise RuntimeError("the grader is down")


def returns_nan(prompts, completions, rows):
    return [1.0] * (len(completions) - 1) + [math.nan]


def returns_none(prompts, completions, rows):
    return [None for _ in completions]


def returns_too_few(prompts, completions, rows):
    return [1.0]


def half_solved(prompts, completions, rows):
    """Prompts with an even answer: every sample scores 1 (a group with nothing to learn,
    which dynamic sampling drops); odd answers: 1 for a completion of odd length, else 0."""
    return [
        1.0 if int(row["ground_truth"]) % 2 == 0 else float(len(text) % 2)
        for text, row in zip(completions, rows, strict=True)
    ]


def rarely_varied(prompts, completions, rows):
    """Like `half_solved`, but only answers that are 1 modulo 4 can vary: few groups kept."""
    return [
        1.0 if int(row["ground_truth"]) % 4 != 1 else float(len(text) % 2)
        for text, row in zip(completions, rows, strict=True)
    ]


def always_one(prompts, completions, rows):
    return [1.0 for _ in completions]


def returns_numpy(prompts, completions, rows):
    """Scores of the types users' reward code returns: numpy and 0-d torch scalars, bools."""
    import numpy as np
    import torch

    kinds = [np.float32(0.1), np.int64(2), np.bool_(True), torch.tensor(0.75), False, 1]
    return [kinds[i % len(kinds)] for i in range(len(completions))]


def returns_inf(prompts, completions, rows):
    return [1.0] * (len(completions) - 1) + [math.inf]


def returns_text(prompts, completions, rows):
    return ["1.0" for _ in completions]
