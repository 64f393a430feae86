"""DAPO dynamic sampling: train only on prompt groups whose samples disagree.

A group whose samples all score the same (all right, all wrong) has zero group-relative
advantage: it costs a rollout and teaches nothing. With `algorithm.filter_groups.enabled`,
a step's rollout is a loop over *rounds* of the data order's *generation batches* of
`data.train_batch_size` (B) prompts:

    g = the step's first generation batch (the one after the previous step's last)
    round 1: roll out and score generation batch g (`adaptive_rounds`: from g on, the whole
        generation batches that hold the prompts the previous step's kept rate says B groups
        take, at least one)
    repeat until B groups whose metric varies (or that have one sample) are kept, at most
    `max_num_gen_batches` generation batches per step (0 = no limit):
        next round: the next generation batches, enough for n = ceil(groups missing / kept
        rate of this step so far) prompts (`adaptive_rounds`; the most the round's decode
        batch holds, `cap`, while no group was kept), one generate call; without
        `adaptive_rounds`, one (verl's recipe)
    the step trains on the first B kept groups, in generation order

A round that starts at generation batch g samples with g's seed, so a round of one batch is
exactly what step g rolls out without filtering (`PromptData.step_rows(g)`). The data order
is one stream and every prompt of it is generated exactly once, as in verl's recipe: rounds
are whole generation batches, a step records the batches its rounds used (and how many
prompts of each: all of them), the next step starts after them, and the groups kept beyond
the B a step trains on are dropped, as verl's recipe drops them. When the limit is reached
with too few groups,
`on_exhausted: fail` stops the run (as verl's DAPO recipe does), `train` fills the batch with
filtered-out groups in generation order.

On a CPU a round of 4 sequences took 60% of the time of one of 32, and one of 128 2.4x
(bench/dynamic_sampling.py): one round of many prompts is cheaper than several of a batch.

`load(j)` / `save(j, part)` let the caller keep each round (j = 1, 2, ...) so that a crash
mid-step resumes without generating a committed one again; the engine knows nothing of where
they are kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from hybrid_engine.batch import Batch
from hybrid_engine.step_metrics import combined_metrics

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


def round_prompts(
    groups: int,
    kept: int,
    consumed: int,
    cap: int,
    adaptive: bool,
    allowed: int | None,
    prior: Sequence[int] | None = None,
) -> int:
    """Prompts of the step's next round (module doc), whole generation batches of `groups`:
    without `adaptive`, one; else those that hold what the kept rate says the missing groups
    take, at most the `cap // groups` batches a round holds and the `allowed` batches left
    of the limit, at least one; the first round takes the rate of `prior` (groups kept,
    prompts used by the step before)."""
    if not adaptive or consumed == 0 and not prior:
        n = groups
    elif consumed == 0:  # the first round, at the rate of the step before
        k, c = prior
        n = cap if k == 0 else math.ceil(groups * c / k)
    elif kept == 0:
        n = cap
    else:
        n = math.ceil((groups - kept) * consumed / kept)
    batches = min(-(-n // groups), cap // groups)
    return groups * max(1, batches if allowed is None else min(batches, allowed))


def dynamic_rollout(
    generate: Callable[[int, int], Batch],
    *,
    first_gen_batch: int,
    groups: int,
    metric: str,
    max_num_gen_batches: int,
    on_exhausted: str,
    pad_token_id: int,
    adaptive: bool = True,
    cap: int | None = None,
    load: Callable[[int], Batch | None] | None = None,
    save: Callable[[int, Batch], None] | None = None,
    prior: Sequence[int] | None = None,
) -> Batch:
    """The step's training batch from as many rounds as it takes (module doc).

    `generate(g, n)` rolls out and scores n prompts from the start of generation batch g (of
    `groups` prompts each) in one call. `prior`: (groups kept, prompts used) of the step
    before, which sizes the first round. The result's meta holds `gen_batches` (the indices
    used), `gen_batch_prompts` (the prompts used of each), `kept_of_prompts` (this step's
    prior for the next), `next_gen_batch` and the step's sampling metrics."""
    parts: list[Batch] = []
    kept: list[str] = []  # uids of the varied groups, in generation order
    used: list[tuple[int, int]] = []  # (generation batch, prompts used of it)
    limit = max_num_gen_batches
    g, consumed = first_gen_batch, 0
    while True:
        j = len(parts) + 1
        part = load(j) if load is not None else None
        if part is None:
            allowed = limit - len(used) if limit else None
            n = round_prompts(groups, len(kept), consumed, cap or groups, adaptive, allowed, prior)
            part = generate(g, n)
            part["kept"] = varied_groups(part, metric)
            part.meta["gen_batch"] = g
            if save is not None:
                save(j, part)
        parts.append(part)
        first, n = part.meta["gen_batch"], len(set(part["uid"]))
        used += [(first + i // groups, min(groups, n - i)) for i in range(0, n, groups)]
        g, consumed = used[-1][0] + 1, consumed + n
        kept += list(dict.fromkeys(u for u, k in zip(part["uid"], part["kept"], strict=True) if k))
        if len(kept) >= groups:
            break
        if limit and len(used) >= limit:
            if on_exhausted == "fail":
                raise DynamicSamplingExhausted(
                    f"dynamic sampling: {len(used)} generation batches (algorithm.filter_groups."
                    f"max_num_gen_batches={max_num_gen_batches}) gave {len(kept)} of the "
                    f"{groups} prompt groups with varied {metric}: the data may be too easy or "
                    "too hard; raise the limit (0 = none) or set "
                    "algorithm.filter_groups.on_exhausted=train"
                )
            break
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
        "gen_batches": [b for b, _ in used],
        "gen_batch_prompts": [n for _, n in used],
        "next_gen_batch": g,
        "kept_of_prompts": [len(kept), consumed],
        "gen_tokens": tokens,
        "gen_tokens_per_s": per_s,
        "metrics": {
            **combined_metrics([p.meta["metrics"] for p in parts]),
            "timing_s/gen": seconds,
            "perf/tokens_per_s_rollout": per_s,
            "dynamic_sampling/gen_batches": float(len(used)),
            "dynamic_sampling/rounds": float(len(parts)),
            "dynamic_sampling/prompts_consumed": float(consumed),
            "dynamic_sampling/kept_groups": float(len(kept)),
            "dynamic_sampling/trained_groups": float(len(set(kept[:groups]))),
        },
    }
    return batch
