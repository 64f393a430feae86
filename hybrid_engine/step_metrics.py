"""What a step reports about itself: stage timers, lengths, throughput, peak memory."""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from hybrid_engine.batch import Batch


@contextmanager
def timer(metrics: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = time.perf_counter() - start


def rollout_timings(meta: dict) -> dict[str, float]:
    """What a generate call reports about itself: `timing_s/reshard` (gathering or pushing
    the weights), and a backend's own metrics (vllm: `timing_s/weight_sync`)."""
    return {"timing_s/reshard": meta.get("reshard_s", 0.0), **meta.get("rollout_metrics", {})}


def combined_metrics(calls: Sequence[dict[str, float]]) -> dict[str, float]:
    """Several generate calls' metrics (DAPO's rounds, multi-turn's turns) as one rollout's:
    seconds (`timing_s/*`) add up, maxima (`*_max`) are the largest call's, the rest is the
    mean over the calls that report it (e.g. vLLM's weight push, made by the first call
    only)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for c in calls for k in c):
        values = [c[key] for c in calls if key in c]
        if key.startswith("timing_s/"):
            out[key] = sum(values)
        elif key.endswith("_max"):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def gap_metrics(
    rollout_log_probs: torch.Tensor, trainer_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Mean and max |rollout - trainer| log-prob over the sampled tokens (mask 1)."""
    return gap_summary([(rollout_log_probs - trainer_log_probs).abs()[mask.bool()]])


def gap_summary(diffs: Sequence[torch.Tensor]) -> dict[str, float]:
    """`rollout/logprob_gap_mean` / `_max` over per-token gaps gathered in pieces."""
    diff = torch.cat([d.float().flatten() for d in diffs]) if diffs else torch.zeros(0)
    if diff.numel() == 0:
        return {}
    return {
        "rollout/logprob_gap_mean": float(diff.mean()),
        "rollout/logprob_gap_max": float(diff.max()),
    }


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def finish_step(metrics: dict[str, float], seconds: float) -> dict[str, float]:
    """A step's metrics from its update's: wall time, tokens/s over the step, peak RSS."""
    metrics = dict(metrics)
    metrics["timing_s/step"] = seconds
    metrics["perf/throughput"] = metrics.pop("_tokens") / seconds
    metrics["perf/peak_rss_gb"] = peak_rss_gb()
    return metrics


def batch_stats(batch: Batch, max_new_tokens: int) -> dict[str, float]:
    """Lengths; clip_ratio = share of responses cut at max_new_tokens (no EOS). Lengths
    count the response's tokens in the attention mask (rejection may zero some in
    response_mask)."""
    width = batch["response_mask"].shape[1]
    lengths = batch["attention_mask"][:, -width:].sum(-1).float()
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= max_new_tokens).float().mean()),
        "prompt_length/mean": float(batch["prompt_mask"].sum(-1).float().mean()),
        "_tokens": float(batch["attention_mask"].sum()),
    }
