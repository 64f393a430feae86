"""Evaluating a policy on the held-out rows: greedy accuracy, pass@k and maj@k (logged as
`eval/pass_at_<k>`, `eval/maj_at_<k>`: MLflow names may not hold '@'), plus the response
statistics a promotion gate checks.

    accuracy       share of questions the greedy response answers correctly
    pass@k         share of questions with at least one correct answer among k samples
                   (the unbiased estimator 1 - C(n-c, k) / C(n, k) with n = k samples)
    maj@k          share of questions whose most frequent extracted answer among the k
                   samples is correct (ties: the answer sampled first; no answer: wrong)
    format_rate    share of greedy responses with an extractable final answer
    response_length/mean, clip_ratio   greedy responses' tokens; share cut at the limit

Samples use the run's `rollout` sampling settings and a fixed seed, so an evaluation is
deterministic on CPU. Single-turn tasks only (a multi-turn run is scored by its validation).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from hybrid_engine.data import prompt_batch
from hybrid_engine.rewards import extract_answer
from hybrid_engine.rollout.base import SamplingParams

EVAL_SEED_STEP = -2  # validation uses -1: a seed of its own


@torch.no_grad()
def evaluate_policy(engine: Any, k: int) -> dict[str, float]:
    """`eval/*` metrics of the policy `engine.actor` holds, on `engine.data.val`."""
    from hybrid_engine.engine import step_seed

    cfg, rows = engine.cfg, engine.data.val
    if not rows:
        raise ValueError("data.val_size is 0: nothing to evaluate on")
    if cfg.rollout.multi_turn.enabled:
        raise ValueError("evaluate: multi-turn runs are scored by their validation only")
    r, limit = cfg.rollout, cfg.rollout.val.max_new_tokens or cfg.rollout.max_new_tokens
    prompts = prompt_batch(rows, engine.tokenizer, cfg.data.max_prompt_length)
    prompts["uid"] = [f"eval-{i}" for i in range(len(prompts))]
    greedy = engine.actor.generate(prompts, SamplingParams(limit, 0.0))
    texts = _texts(engine, greedy)
    scores = engine.scorer.score([""] * len(rows), texts, rows)
    lengths = greedy["response_mask"].sum(-1).float()
    seed = step_seed(cfg.trainer.seed, EVAL_SEED_STEP)
    sampled = engine.actor.generate(
        prompts.repeat_interleave(k), SamplingParams(limit, r.temperature, r.top_p, r.top_k, seed)
    )
    s_texts = _texts(engine, sampled)
    s_scores = engine.scorer.score(
        [""] * len(s_texts), s_texts, [row for row in rows for _ in range(k)]
    )
    fmt = cfg.reward.answer_format
    pass_k = maj_k = 0.0
    for i in range(len(rows)):
        group = list(range(i * k, (i + 1) * k))
        pass_k += float(any(s_scores[j] >= 1.0 for j in group))
        answers = [extract_answer(s_texts[j], fmt) for j in group]
        votes = Counter(a for a in answers if a is not None)
        if votes:
            top = max(votes.values())
            winner = next(j for j, a in zip(group, answers, strict=True) if votes.get(a) == top)
            maj_k += float(s_scores[winner] >= 1.0)
    n = len(rows)
    return {
        "eval/accuracy": sum(s >= 1.0 for s in scores) / n,
        f"eval/pass_at_{k}": pass_k / n,
        f"eval/maj_at_{k}": maj_k / n,
        "eval/format_rate": sum(extract_answer(t, fmt) is not None for t in texts) / n,
        "eval/response_length/mean": float(lengths.mean()),
        "eval/clip_ratio": float((lengths >= limit).float().mean()),
        "eval/questions": float(n),
    }


def _texts(engine: Any, batch: Any) -> list[str]:
    ids, mask = batch["response_ids"], batch["response_mask"]
    return [
        engine.tokenizer.decode(ids[i][mask[i].bool()], skip_special_tokens=True)
        for i in range(len(ids))
    ]
