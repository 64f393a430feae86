"""DAPO dynamic sampling: train only on prompt groups whose samples disagree.

A group whose samples all score the same (all right, all wrong) has zero group-relative
advantage: it costs a rollout and teaches nothing. With `algorithm.filter_groups.enabled`,
a step's rollout is a loop over *generation batches* of `data.train_batch_size` prompts:

    g = the step's first generation batch (the one after the previous step's last)
    repeat:  roll out and score generation batch g; keep its groups whose metric varies
             (or that have one sample); stop once `data.train_batch_size` groups are kept;
             else g += 1 (at most `max_num_gen_batches` per step, 0 = no limit)
    the step trains on the first `data.train_batch_size` kept groups, in generation order

Generation batch g takes the prompts and sampling seed that step g takes without filtering
(`PromptData.step_rows(g)`), so the data order is one stream and each prompt is consumed
once: a step records its generation batches, and the next step starts after them. When the
limit is reached with too few groups, `on_exhausted: fail` stops the run (as verl's DAPO
recipe does), `train` fills the batch with filtered-out groups in generation order.

`load(j)` / `save(j, part)` let the caller keep each generation batch (j = 1, 2, ...) so
that a crash mid-step resumes without generating a committed one again; the engine knows
nothing of where they are kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_engine.batch import Batch

# fields of a rollout batch that are left-padded prompts, and the joined sequences
_PROMPT = ("prompt_ids", "prompt_mask")
_JOINED = ("input_ids", "attention_mask")
_PADDED_WITH_PAD_ID = ("prompt_ids", "response_ids", "baseline_response_ids")


class DynamicSamplingExhausted(RuntimeError):
    """`max_num_gen_batches` generation batches did not yield enough varied groups."""


def group_metric(batch: Batch, metric: str) -> torch.Tensor:
    """Per sample: "acc" (the scorer said correct: score >= 1) or "score" (the shaped
    sequence score: scorer + overlong penalty)."""
    if metric == "acc":
        return batch["acc"].float()
    return batch["token_level_scores"].sum(-1).float()


def varied_groups(batch: Batch, metric: str) -> torch.Tensor:
    """Per sample: True where its group's metric is not constant, or the group has one sample
    (verl keeps a group when the metric's std > 0 or it has a single sample)."""
    values = group_metric(batch, metric)
    by_uid: dict[str, list[float]] = {}
    for uid, v in zip(batch["uid"], values.tolist(), strict=True):
        by_uid.setdefault(uid, []).append(v)
    keep = {u: len(v) == 1 or max(v) != min(v) for u, v in by_uid.items()}
    return torch.tensor([keep[u] for u in batch["uid"]])


def concat_rollouts(parts: list[Batch], pad_token_id: int) -> Batch:
    """Rollout batches of different widths as one: prompts left-padded, responses (and every
    other per-token field) right-padded to the widest, the joined sequences rebuilt."""
    if len(parts) == 1:
        return parts[0]
    widths: dict[str, int] = {}
    for p in parts:
        for k, t in p.tensors.items():
            if t.dim() == 2 and k not in _JOINED:
                widths[k] = max(widths.get(k, 0), t.shape[1])
    padded = []
    for p in parts:
        tensors = {}
        for k, t in p.tensors.items():
            if k in _JOINED:
                continue
            if t.dim() == 2 and t.shape[1] < widths[k]:
                value = pad_token_id if k in _PADDED_WITH_PAD_ID else 0
                extra = widths[k] - t.shape[1]
                pad = (extra, 0) if k in _PROMPT else (0, extra)
                t = torch.nn.functional.pad(t, pad, value=value)
            tensors[k] = t
        tensors["input_ids"] = torch.cat([tensors["prompt_ids"], tensors["response_ids"]], 1)
        tensors["attention_mask"] = torch.cat([tensors["prompt_mask"], tensors["response_mask"]], 1)
        padded.append(Batch(tensors, p.non_tensors, p.meta))
    return Batch.concat(padded)


def dynamic_rollout(
    generate: Callable[[int], Batch],
    first_gen_batch: int,
    groups: int,
    metric: str,
    max_num_gen_batches: int,
    on_exhausted: str,
    pad_token_id: int,
    load: Callable[[int], Batch | None] | None = None,
    save: Callable[[int, Batch], None] | None = None,
) -> Batch:
    """The step's training batch from as many generation batches as it takes (module doc).

    `generate(g)` rolls out and scores generation batch g. The result's meta holds
    `gen_batches` (the indices used), `next_gen_batch` and the step's sampling metrics."""
    parts: list[Batch] = []
    kept: list[str] = []  # uids of the varied groups, in generation order
    g = first_gen_batch
    while True:
        j = len(parts) + 1
        part = load(j) if load is not None else None
        if part is None:
            part = generate(g)
            part["kept"] = varied_groups(part, metric)
            part.meta["gen_batch"] = g
            if save is not None:
                save(j, part)
        parts.append(part)
        kept += list(dict.fromkeys(u for u, k in zip(part["uid"], part["kept"], strict=True) if k))
        if len(kept) >= groups:
            break
        if max_num_gen_batches and j >= max_num_gen_batches:
            if on_exhausted == "fail":
                raise DynamicSamplingExhausted(
                    f"dynamic sampling: {j} generation batches (algorithm.filter_groups."
                    f"max_num_gen_batches={max_num_gen_batches}) gave {len(kept)} of the "
                    f"{groups} prompt groups with varied {metric}: the data may be too easy or "
                    "too hard; raise the limit (0 = none) or set "
                    "algorithm.filter_groups.on_exhausted=train"
                )
            break
        g += 1
    everything = concat_rollouts(parts, pad_token_id)
    uids = list(dict.fromkeys(everything["uid"]))
    kept_set = set(kept)
    chosen = kept[:groups]
    chosen += [u for u in uids if u not in kept_set][: groups - len(chosen)]  # fill (train)
    chosen_set = set(chosen)
    rows = [i for i, u in enumerate(everything["uid"]) if u in chosen_set]
    batch = everything.take(rows)
    seconds = sum(p.meta["metrics"]["timing_s/gen"] for p in parts)
    tokens = sum(p.meta.get("gen_tokens", 0) for p in parts)
    per_s = tokens / seconds if seconds else 0.0
    batch.meta = {
        **parts[-1].meta,
        "gen_batches": [p.meta["gen_batch"] for p in parts],
        "next_gen_batch": parts[-1].meta["gen_batch"] + 1,
        "gen_tokens": tokens,
        "gen_tokens_per_s": per_s,
        "metrics": {
            **parts[-1].meta["metrics"],
            "timing_s/gen": seconds,
            "perf/tokens_per_s_rollout": per_s,
            "dynamic_sampling/gen_batches": float(len(parts)),
            "dynamic_sampling/prompts_consumed": float(sum(len(set(p["uid"])) for p in parts)),
            "dynamic_sampling/kept_groups": float(len(kept)),
            "dynamic_sampling/trained_groups": float(len(set(kept[:groups]))),
        },
    }
    return batch
