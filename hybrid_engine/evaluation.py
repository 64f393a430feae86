"""Validating and evaluating a policy on the held-out rows. `validate`: the run's validation
(greedy by default; `val/*`). `evaluate_policy`: greedy accuracy, pass@k and maj@k (logged as
`eval/pass_at_<k>`, `eval/maj_at_<k>`: MLflow names may not hold '@'), plus the response
statistics a promotion gate checks.

    accuracy       share of questions the greedy response answers correctly
    pass@k         share of questions with at least one correct answer among k samples
                   (the unbiased estimator 1 - C(n-c, k) / C(n, k) with n = k samples)
    mixed@k        share of questions with some but not all of the k samples correct: the
                   prompt groups GRPO learns from (all right or all wrong: advantage 0)
    maj@k          share of questions whose most frequent extracted answer among the k
                   samples is correct (ties: the answer sampled first; no answer: wrong)
    format_rate    share of greedy responses with an extractable final answer
    response_length/mean, clip_ratio   greedy responses' tokens; share cut at the limit

Samples use the run's `rollout` sampling settings and a fixed seed, so an evaluation is
deterministic on CPU. Single-turn tasks only (a multi-turn run is scored by its validation).
`greedy_heldout` scores any trainer's policy (a plain transformers module) the same way as
the greedy half of `evaluate_policy`: answer-correct and format-correct shares.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch

from hybrid_engine.data import prompt_batch
from hybrid_engine.rewards import RewardScorer, extract_answer, format_correct
from hybrid_engine.rollout.base import SamplingParams, step_seed
from hybrid_engine.rollout.hf import HFRollout
from hybrid_engine.rollout.multiturn import conversation_text, multi_turn_metrics

EVAL_SEED_STEP = -2  # validation uses -1: a seed of its own


@torch.no_grad()
def validate(engine: Any, samples: int = 0) -> dict[str, Any]:
    """Greedy (by default) generation on the held-out rows; accuracy = share scored 1.
    With `samples`, `_samples` holds the first ones: {prompt, response, score}."""
    rows = engine.data.val
    if not rows:
        return {}
    v, r = engine.cfg.rollout.val, engine.cfg.rollout
    sampling = SamplingParams(
        v.max_new_tokens or r.max_new_tokens,
        v.temperature,
        r.top_p,
        r.top_k,
        step_seed(engine.cfg.trainer.seed, -1),
    )
    start = time.perf_counter()
    prompts = prompt_batch(rows, engine.tokenizer, engine.cfg.data.max_prompt_length)
    prompts["uid"] = [f"val-{i}" for i in range(len(prompts))]
    batch = engine.generate(prompts, sampling)
    if "turns" in batch:  # multi-turn: success as the environment says, turns, tool use
        score_t, acc, _ = engine.scoring.turn_scores(batch)
        scores, correct = score_t.tolist(), acc.tolist()
    else:
        scores = engine.scoring.score(batch)
        correct = [s >= 1.0 for s in scores]
    at = list(range(len(batch)))  # the batch row of each prompt
    if "episode" in batch:  # agent episodes: one score each, its final answer's; a dropped
        # one scores 0
        final: dict[int, int] = {}
        for j, (e, last) in enumerate(zip(batch["episode"], batch["episode_final"], strict=True)):
            if last or e not in final:
                final[e] = j
        at = [final.get(i, -1) for i in range(len(prompts))]
        scores = [scores[j] if j >= 0 else 0.0 for j in at]
        correct = [bool(correct[j]) if j >= 0 else False for j in at]
    out: dict[str, Any] = {
        "val/accuracy": sum(correct) / len(correct),
        "val/score/mean": sum(scores) / len(scores),
        "val/response_length/mean": float(batch["response_mask"].sum(-1).float().mean()),
        "timing_s/val": time.perf_counter() - start,
    }
    if "agent_fault" in batch:
        out |= multi_turn_metrics(batch, "val/", ("done", "fault"))
        out["val/agent/fault_rate"] = batch.meta["agent_metrics"]["agent/fault_rate"]
    elif "turns" in batch:
        out |= multi_turn_metrics(batch, "val/")
    if samples:
        ids, mask = batch["response_ids"], batch["response_mask"]
        out["_samples"] = [
            {
                "prompt": row["prompt"][-1]["content"],
                "score": score,
                "response": "(dropped: the agent faulted)"
                if j < 0
                else conversation_text(batch["messages"][j])
                if "messages" in batch
                else engine.tokenizer.decode(ids[j][mask[j].bool()], skip_special_tokens=True),
            }
            for j, row, score in zip(at, rows[:samples], scores, strict=False)
        ]
    return out


def group_shares(scores: list[float], k: int) -> tuple[float, float]:
    """pass@k and mixed@k of scores listed k per question, question after question."""
    groups = [scores[i : i + k] for i in range(0, len(scores), k)]
    right = [sum(s >= 1.0 for s in g) for g in groups]
    return sum(r > 0 for r in right) / len(groups), sum(0 < r < k for r in right) / len(groups)


@torch.no_grad()
def evaluate_policy(engine: Any, k: int) -> dict[str, float]:
    """`eval/*` metrics of the policy `engine.actor` holds, on `engine.data.val`."""
    cfg, rows = engine.cfg, engine.data.val
    if not rows:
        raise ValueError("data.val_size is 0: nothing to evaluate on")
    if cfg.rollout.multi_turn.enabled or cfg.rollout.agent.function:
        raise ValueError("evaluate: multi-turn and agent runs are scored by their validation only")
    r, limit = cfg.rollout, cfg.rollout.val.max_new_tokens or cfg.rollout.max_new_tokens
    prompts = prompt_batch(rows, engine.tokenizer, cfg.data.max_prompt_length)
    prompts["uid"] = [f"eval-{i}" for i in range(len(prompts))]
    greedy = engine.actor.generate(prompts, SamplingParams(limit, 0.0))
    texts = _texts(engine.tokenizer, greedy)
    scores = engine.scoring.scorer.score([""] * len(rows), texts, rows)
    lengths = greedy["response_mask"].sum(-1).float()
    seed = step_seed(cfg.trainer.seed, EVAL_SEED_STEP)
    sampled = engine.actor.generate(
        prompts.repeat_interleave(k), SamplingParams(limit, r.temperature, r.top_p, r.top_k, seed)
    )
    s_texts = _texts(engine.tokenizer, sampled)
    s_scores = engine.scoring.scorer.score(
        [""] * len(s_texts), s_texts, [row for row in rows for _ in range(k)]
    )
    fmt = cfg.reward.answer_format
    pass_k, mixed_k = group_shares(s_scores, k)
    maj_k = 0.0
    for i in range(len(rows)):
        group = list(range(i * k, (i + 1) * k))
        answers = [extract_answer(s_texts[j], fmt) for j in group]
        votes = Counter(a for a in answers if a is not None)
        if votes:
            top = max(votes.values())
            winner = next(j for j, a in zip(group, answers, strict=True) if votes.get(a) == top)
            maj_k += float(s_scores[winner] >= 1.0)
    n = len(rows)
    return {
        "eval/accuracy": sum(s >= 1.0 for s in scores) / n,
        f"eval/pass_at_{k}": pass_k,
        f"eval/maj_at_{k}": maj_k / n,
        f"eval/mixed_at_{k}": mixed_k,
        "eval/format_rate": sum(format_correct(t, fmt) for t in texts) / n,
        "eval/response_length/mean": float(lengths.mean()),
        "eval/clip_ratio": float((lengths >= limit).float().mean()),
        "eval/questions": float(n),
    }


@torch.no_grad()
def greedy_heldout(
    model: torch.nn.Module, tokenizer: Any, rows: list[dict[str, Any]], cfg: Any
) -> dict[str, float]:
    """Greedy scores of a plain transformers causal LM (hybridrl's policy or another
    trainer's) on `rows`, as a run with config `cfg` validates: its prompt template, the `hf`
    rollout's decode at `rollout.val.max_new_tokens` (else `rollout.max_new_tokens`) and
    `rollout.micro_batch_size` slots, its scorer. Returns the shares answer_correct (scored 1)
    and format_correct (`rewards.format_correct`), the mean response length, the count."""
    if not rows:
        raise ValueError("greedy_heldout: no held-out rows")
    r = cfg.rollout
    rollout = HFRollout(model, tokenizer.pad_token_id, tokenizer.eos_token_id, r.micro_batch_size)
    prompts = prompt_batch(rows, tokenizer, cfg.data.max_prompt_length)
    greedy = rollout.generate(
        prompts, SamplingParams(r.val.max_new_tokens or r.max_new_tokens, 0.0)
    )
    texts = _texts(tokenizer, greedy)
    scorer = RewardScorer(cfg.reward.function, cfg.reward.answer_format, cfg.data.task_config)
    scores = scorer.score([""] * len(rows), texts, rows)
    n = len(rows)
    return {
        "answer_correct": sum(s >= 1.0 for s in scores) / n,
        "format_correct": sum(format_correct(t, cfg.reward.answer_format) for t in texts) / n,
        "response_length": float(greedy["response_mask"].sum(-1).float().mean()),
        "questions": float(n),
    }


def _texts(tokenizer: Any, batch: Any) -> list[str]:
    ids, mask = batch["response_ids"], batch["response_mask"]
    return [
        tokenizer.decode(ids[i][mask[i].bool()], skip_special_tokens=True) for i in range(len(ids))
    ]
