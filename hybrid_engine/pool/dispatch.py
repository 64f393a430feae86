"""How a worker group splits a `Batch` over its data-parallel ranks and gathers the results.

Three modes, so that the driver writes `actor.generate(batch)` and never loops over ranks:
- split (`split_rows` / `gather_rows`): rank r gets rows [r*k, (r+1)*k). A batch whose length
  does not divide by the rank count is padded with copies of its last row (every rank must run
  the same number of forward passes under FSDP) and the copies are dropped on the way back.
  Each part carries `meta["row_offset"]`, its first row's index in the whole batch.
- update (`split_for_update`): every mini-batch is divided over the ranks, so one optimizer
  step sees the same samples as it would on one rank.
- all / rank zero: the same arguments to every rank; all results, or rank 0's.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from hybrid_engine.batch import Batch
from hybrid_engine.rollout.base import PREFIX_COUNTS


def split_rows(batch: Batch, ranks: int) -> tuple[list[Batch], int]:
    """`ranks` equal parts (after padding) and the number of padding rows added."""
    n = len(batch)
    if n == 0:
        raise ValueError("cannot dispatch an empty batch")
    pad = -n % ranks
    if pad:
        batch = Batch.concat([batch, batch.take([n - 1] * pad)])
    parts = batch.chunk(ranks)
    size = len(parts[0])
    for r, part in enumerate(parts):
        part.meta["row_offset"] = int(batch.meta.get("row_offset", 0)) + r * size
    return parts, pad


def split_for_update(batch: Batch, ranks: int, mini_batch_size: int) -> list[Batch]:
    """Rank r gets the r-th slice of every mini-batch, mini-batches kept in order. A batch
    whose length does not divide into mini-batches (agent episodes give a varying number of
    sequences) is filled up with copies of its last row whose `response_mask` is 0: no loss
    counts a row without a masked token."""
    if pad := -len(batch) % mini_batch_size:
        filler = batch.take([len(batch) - 1] * pad)
        filler["response_mask"] = torch.zeros_like(filler["response_mask"])
        batch = Batch.concat([batch, filler])
    if mini_batch_size % ranks:
        raise ValueError(
            f"a batch of {len(batch)} samples cannot be divided into mini-batches of "
            f"{mini_batch_size} over {ranks} ranks"
        )
    per = mini_batch_size // ranks
    index: list[list[int]] = [[] for _ in range(ranks)]
    for start in range(0, len(batch), mini_batch_size):
        for r in range(ranks):
            index[r] += range(start + r * per, start + (r + 1) * per)
    return [batch.take(idx) for idx in index]


def pad_value(key: str, pad_token_id: int) -> int:
    """Token-id fields pad with the pad token, everything else with 0."""
    return pad_token_id if key.endswith("_ids") else 0


def gather_rows(parts: list[Batch], pad: int, pad_token_id: int) -> Batch:
    """Concatenate the ranks' results in rank order, right-padding 2-D fields whose widths
    differ (each rank's responses are as long as its own longest), then drop `pad` rows."""
    widths: dict[str, int] = defaultdict(int)
    for p in parts:
        for k, t in p.tensors.items():
            if t.dim() >= 2:
                widths[k] = max(widths[k], t.shape[1])
    padded = []
    for p in parts:
        tensors = dict(p.tensors)
        for k, w in widths.items():
            t = tensors[k]
            if t.shape[1] < w:
                fill = torch.nn.functional.pad(
                    t, (0, w - t.shape[1]), value=pad_value(k, pad_token_id)
                )
                tensors[k] = fill
        padded.append(Batch(tensors, p.non_tensors, p.meta))
    out = Batch.concat(padded)
    if pad:
        out = out.take(slice(0, len(out) - pad))
    out.meta = merge_meta([p.meta for p in parts])
    out.meta.pop("row_offset", None)
    return out


def merge_meta(metas: list[dict]) -> dict:
    """Rank 0's meta, with token counts (and prefix-cache counts) summed and timings taken
    from the slowest rank."""
    out = dict(metas[0])
    if all("gen_tokens" in m for m in metas):
        out["gen_tokens"] = sum(m["gen_tokens"] for m in metas)
        out["gen_seconds"] = max(m["gen_seconds"] for m in metas)
        out["gen_tokens_per_s"] = out["gen_tokens"] / max(out["gen_seconds"], 1e-9)
    for key in PREFIX_COUNTS:
        if all(key in m for m in metas):
            out[key] = sum(m[key] for m in metas)
    if all("reshard_s" in m for m in metas):
        out["reshard_s"] = max(m["reshard_s"] for m in metas)
    if all(m.get("rollout_metrics") for m in metas):  # a backend's own: means, else the worst
        merged = {}
        for k in metas[0]["rollout_metrics"]:
            values = [m["rollout_metrics"][k] for m in metas]
            merged[k] = sum(values) / len(values) if k.endswith("_mean") else max(values)
        out["rollout_metrics"] = merged
    return out


def mean_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    """Per-key mean over the ranks' metric dicts; maxima (`*_max`) are the largest rank's."""
    keys = dict.fromkeys(k for r in results for k in r)
    out = {}
    for k in keys:
        values = [r[k] for r in results if k in r]
        out[k] = max(values) if k.endswith("_max") else sum(values) / len(values)
    return out
