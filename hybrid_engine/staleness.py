"""Asynchronous (off-policy) training: which weights each rollout uses, how they reach the
rollout group, and how stale the samples are when they train.

With `trainer.max_staleness = k` the rollout of step N uses weights version

    v(N) = max(0, N - 1 - k)

so it can run while steps N-k .. N-1 train (k = 0 is the synchronous loop: version N-1).
The schedule alone fixes the version -- never which process finished first -- so an
asynchronous run is as deterministic as a synchronous one, and a resumed run regenerates a
rollout with exactly the weights the uninterrupted run used.

The samples of step N train when the trainer holds version N-1: their staleness is
N-1-v(N) <= k. The training side computes its own old log-probs; the rollout's log-probs
(from the replica that sampled them) and the IS weights of `algorithm.rollout_correction`
correct the difference.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def rollout_version(step: int, max_staleness: int) -> int:
    """The weights version the rollout of `step` generates with."""
    return max(0, step - 1 - max_staleness)


class StaleSamples(ValueError):
    """Samples older than trainer.max_staleness versions reached the trainer."""


def staleness_metrics(
    versions: torch.Tensor, trainer_version: int, max_staleness: int, step: int
) -> dict[str, float]:
    """`async/staleness/*` of a batch about to train: trainer version - sample version, per
    sample. More than `max_staleness` is refused (the schedule guarantees it never is)."""
    stale = (trainer_version - versions).float()
    if float(stale.max()) > max_staleness or float(stale.min()) < 0:
        raise StaleSamples(
            f"step {step}: samples of weights versions {sorted(set(versions.tolist()))} with the "
            f"trainer at version {trainer_version}: staleness outside 0..trainer.max_staleness="
            f"{max_staleness}"
        )
    return {
        "async/staleness/mean": float(stale.mean()),
        "async/staleness/max": float(stale.max()),
        "async/weights_version": float(versions.float().mean()),
    }


class WeightsFeed:
    """The trainer's weights on their way to the rollout group (`ray.rollout=separate`).

    `publish()` puts the weights the trainer holds now into Ray's object store (once per
    version); `feed(v)` makes the replicas hold version v. The k+1 newest versions are kept:
    the rollouts that may still be waiting use no older ones."""

    def __init__(self, trainer: Any, replicas: Any, max_staleness: int) -> None:
        self.trainer, self.replicas, self.keep = trainer, replicas, max_staleness + 1
        self.published: dict[int, tuple[list, float]] = {}  # version -> ([ref], seconds)

    def publish(self) -> int:
        """Publish the trainer's current version (no-op if it is); returns it."""
        version = self.trainer.weights_version
        if version not in self.published:
            start = time.perf_counter()
            holder = self.trainer.publish_weights()
            self.published[version] = (holder, time.perf_counter() - start)
            for old in sorted(self.published)[: -self.keep]:
                del self.published[old]
        return version

    def feed(self, version: int) -> dict[str, float]:
        """Make the replicas hold `version`; the publish and load seconds as metrics."""
        if self.replicas.weights_version == version:
            return {"timing_s/weight_sync": 0.0}
        if version not in self.published:
            raise RuntimeError(
                f"the rollout needs weights version {version}, which the trainer did not "
                f"publish (published: {sorted(self.published)})"
            )
        holder, publish_s = self.published[version]
        sync_s = self.replicas.receive_weights(holder, version)
        return {"timing_s/weight_publish": publish_s, "timing_s/weight_sync": sync_s}

    def clear(self) -> None:
        """Forget what was published (the pool that held it is gone)."""
        self.published.clear()


def sampled_at(versions: torch.Tensor | None, version: int) -> bool:
    """Whether every row was sampled from weights `version` (rows without a recorded
    version, from stages committed before the field existed, count as such)."""
    return versions is None or bool((versions == version).all())
