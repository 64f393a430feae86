"""Rewards: one float per response, placed on its last token.

Scorers, chosen per row:
- reasoning-gym rows: the generator's own `score_answer` on the extracted final answer;
- other rows: a numeric rule (the extracted answer equals `reward_model.ground_truth`);
- `reward.function: module:function` overrides both. It is called as
  `fn(prompts=[str], completions=[str], rows=[dict]) -> sequence of real numbers`
  (Python, numpy or 0-d torch scalars; a bool is 0/1; NaN/inf are refused, the row named).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import torch

from hybrid_engine.batch import Batch
from hybrid_engine.data import RG_PREFIX
from hybrid_engine.specs import load_spec

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class RewardError(RuntimeError):
    """A reward could not be computed; the message names the sample."""


def as_reward(value: Any) -> float:
    """A reward as a float: any real number (Python, numpy or a 0-d torch tensor; a
    bool counts 0/1), `ValueError` naming it for a non-number or NaN/inf."""
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # numpy, 0-d tensor
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ValueError(f"{type(value).__name__} {str(value)[:60]!r}, not a real number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"a non-finite reward ({out})")
    return out


def extract_answer(text: str, answer_format: str = "last_number") -> str | None:
    """The final answer of a completion: the last number, or what follows `####`."""
    if answer_format == "hashes":
        if "####" not in text:
            return None
        text = text.rsplit("####", 1)[1]
        found = _NUMBER.findall(text)
        return found[0].replace(",", "") if found else text.strip() or None
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def format_correct(text: str, answer_format: str = "last_number") -> bool:
    """Format-correct: the scorer can read a final answer from the completion, the answer
    format the presets' system prompts ask for (`last_number`: a plain number, the last one
    is the answer; `hashes`: an answer after `####`). Answer-correct is scored on that same
    answer, so an answer-correct response is always format-correct."""
    return extract_answer(text, answer_format) is not None


def numeric_match(answer: str | None, ground_truth: Any) -> float:
    """1.0 when the answer equals the ground truth as a number (or as text), else 0.0."""
    if answer is None:
        return 0.0
    try:
        return float(math.isclose(float(answer), float(str(ground_truth).replace(",", ""))))
    except ValueError:
        return float(answer.strip() == str(ground_truth).strip())


@cache
def _rg_scorer(task: str, task_config_items: tuple) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0, **dict(task_config_items))


def _freeze(x: Any) -> Any:
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, list):
        return tuple(_freeze(v) for v in x)
    return x


def load_function(spec: str) -> Callable[..., Sequence[float]]:
    return load_spec(spec, "reward.function")


def builtin_score(
    text: str, row: dict[str, Any], answer_format: str = "last_number", task_config: Any = ()
) -> float:
    """The built-in score of one completion: reasoning-gym's own scorer for its rows (on the
    extracted answer), else the numeric match with `row["ground_truth"]`."""
    answer = extract_answer(text, answer_format)
    entry = (row.get("extra_info") or {}).get("rg_entry")
    if row["data_source"].startswith(RG_PREFIX) and entry is not None:
        scorer = _rg_scorer(row["data_source"].removeprefix(RG_PREFIX), _freeze(task_config))
        return float(scorer.score_answer(answer, entry))
    return numeric_match(answer, row["ground_truth"])


class RewardScorer:
    """Scores completions for rows; the same object serves training and validation."""

    def __init__(
        self, function: str | None, answer_format: str, task_config: dict[str, Any]
    ) -> None:
        self.fn = load_function(function) if function else None
        self.answer_format = answer_format
        self.task_config = _freeze(task_config)

    def score(
        self, prompts: list[str], completions: list[str], rows: list[dict[str, Any]]
    ) -> list[float]:
        scores = (
            self._user(prompts, completions, rows) if self.fn else self._builtin(completions, rows)
        )
        out = []
        for i, s in enumerate(scores):
            try:
                out.append(as_reward(s))
            except ValueError:
                raise RewardError(
                    f"reward for sample {i} is {s!r}, not a finite real number "
                    f"(prompt: {prompts[i][-80:]!r}, completion: {completions[i][:80]!r})"
                ) from None
        return out

    def _builtin(self, completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
        return [
            builtin_score(text, row, self.answer_format, self.task_config)
            for text, row in zip(completions, rows, strict=True)
        ]

    def _user(self, prompts: list[str], completions: list[str], rows: list[dict[str, Any]]) -> list:
        try:
            scores = list(self.fn(prompts=prompts, completions=completions, rows=rows))
        except Exception as batch_error:
            # Find the sample that breaks it, so the message can name it.
            for i in range(len(prompts)):
                try:
                    self.fn(
                        prompts=prompts[i : i + 1],
                        completions=completions[i : i + 1],
                        rows=rows[i : i + 1],
                    )
                except Exception as e:
                    raise RewardError(
                        f"reward function failed on sample {i} (completion "
                        f"{completions[i][:80]!r}): {type(e).__name__}: {e}"
                    ) from e
            raise RewardError(
                f"reward function failed on the batch: {batch_error}"
            ) from batch_error
        if len(scores) != len(prompts):
            raise RewardError(
                f"reward function returned {len(scores)} scores for {len(prompts)} samples"
            )
        return scores


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment, per response of length L (tokens):

    0                                  if L <= max_len - buffer_len
    -factor * (L - (max_len - buffer_len)) / buffer_len   otherwise (-factor at max_len)
    """
    if buffer_len <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer_len)).clamp(min=0)
    return -factor * (over / buffer_len).clamp(max=1.0)


def token_level_scores(
    scores: Sequence[float] | torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """(batch, response_len) zeros with each score on its response's last token: the last
    position whose mask is 1 (multi-turn masks have interior zeros; an empty row: position 0)."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = last_token_index(response_mask)
    out[torch.arange(len(scores)), last] = torch.as_tensor(scores, dtype=torch.float32)
    return out


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """(batch,) index of each row's last position with mask 1 (0 for a row without one)."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    return torch.where(response_mask.bool(), positions, 0).amax(-1)


def score_responses(
    batch: Batch,
    ids_key: str,
    mask_key: str,
    tokenizer: Any,
    scorer: RewardScorer,
    reward_model: Any = None,
) -> list[float]:
    """One score per sample of `batch` (responses under `ids_key` / `mask_key`): the reward
    model's, if there is one (a role with `score`), else the scorer's on the decoded text (a
    multi-turn trajectory's final answer)."""
    ids, mask = batch[ids_key], batch[mask_key]
    if reward_model is not None:
        scored = reward_model.score(
            Batch(
                {
                    "input_ids": torch.cat([batch["prompt_ids"], ids], 1),
                    "attention_mask": torch.cat([batch["prompt_mask"], mask], 1),
                    "response_mask": mask,
                }
            )
        )
        return scored["rm_scores"].tolist()
    completions = (
        list(batch["final_response"])
        if "final_response" in batch  # multi-turn
        else [
            tokenizer.decode(row[m.bool()], skip_special_tokens=True)
            for row, m in zip(ids, mask, strict=True)
        ]
    )
    prompts = [tokenizer.apply_chat_template(p, tokenize=False) for p in batch["prompt"]]
    rows = [
        {"data_source": d, "ground_truth": g, "extra_info": e, "prompt": p}
        for d, g, e, p in zip(
            batch["data_source"],
            batch["ground_truth"],
            batch["extra_info"],
            batch["prompt"],
            strict=True,
        )
    ]
    return scorer.score(prompts, completions, rows)
