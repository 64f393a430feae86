"""A role served by a worker group of the pool (`RoleProxy`): the same methods as the
in-process role, each a call on the group's ranks with the batch split or gathered."""

from __future__ import annotations

from typing import TYPE_CHECKING

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from hybrid_engine.batch import Batch
from hybrid_engine.config import HybridConfig
from hybrid_engine.rollout.base import SamplingParams

if TYPE_CHECKING:
    from hybrid_engine.pool.group import WorkerGroup


class RoleProxy:
    """A role served by a group, with the same methods as the in-process role."""

    def __init__(self, group: WorkerGroup, role: str, cfg: HybridConfig) -> None:
        self.group, self.role, self.cfg = group, role, cfg

    # actor-rollout-ref
    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        return self.group.call_split(self.role, "generate", batch, sampling)

    def compute_log_prob(self, batch: Batch) -> Batch:
        return self.group.call_split(self.role, "compute_log_prob", _inputs(batch))

    def rollout_progress(self) -> dict[str, float] | None:
        """The generate call running now, over all ranks (None when none runs)."""
        refs = [h.rollout_progress.remote(self.role) for h in self.group.handles]
        try:
            parts = [p for p in ray.get(refs, timeout=5.0) if p]
        except (RayActorError, GetTimeoutError):
            return None
        if not parts:
            return None
        return {
            "tokens": sum(p["tokens"] for p in parts),
            "seconds": max(p["seconds"] for p in parts),
        }

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return self.group.call_split(self.role, "compute_ref_log_prob", _inputs(batch))

    def publish_weights(self) -> list:
        """The full weights in Ray's object store: `[ref]` (hybrid_engine.pool.replica)."""
        with self.group.turn():
            refs = [
                h.publish.remote(self.role, driver=self.group.driver) for h in self.group.handles
            ]
            return self.group.wait(refs, f"{self.role}.publish")[0]

    def receive_weights(self, holder: list, version: int) -> float:
        """Every replica loads the published weights; the slowest one's seconds."""
        with self.group.turn():
            refs = [
                h.receive.remote(self.role, holder, version, driver=self.group.driver)
                for h in self.group.handles
            ]
            return max(self.group.wait(refs, f"{self.role}.receive"))

    def update_actor(self, batch: Batch) -> dict[str, float]:
        return self.group.call_update(
            self.role, "update_actor", _train(batch), self.cfg.actor.ppo_mini_batch_size
        )

    # critic
    def compute_values(self, batch: Batch) -> Batch:
        return self.group.call_split(self.role, "compute_values", _inputs(batch))

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self.group.call_update(
            self.role, "update_critic", _train(batch), self.cfg.critic.ppo_mini_batch_size
        )

    # reward model
    def score(self, batch: Batch) -> Batch:
        return self.group.call_split(self.role, "score", _inputs(batch))

    # state
    def save(self, url: str, storage_options: dict | None = None) -> dict[str, str]:
        """Every rank writes its part; {file name: sha256} of all of them."""
        parts = self.group.call_all(self.role, "save", url, storage_options)
        return {name: sha for part in parts for name, sha in part.items()}

    def load(
        self, url: str, storage_options: dict | None = None, expected: dict | None = None
    ) -> int:
        return self.group.call_all(self.role, "load", url, storage_options, expected)[0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.group.call_all(self.role, "full_state_dict")[0]

    def invalidate(self) -> None:
        self.group.call_all(self.role, "invalidate")

    @property
    def weights_version(self) -> int:
        """Rank 0's version (the ranks step together)."""
        return self.group.role_info(self.role, "weights_version")["weights_version"]

    @property
    def weights_run(self) -> str | None:
        """The run whose updates made the weights rank 0 holds (None = fresh)."""
        return self.group.role_info(self.role, "weights_run")["weights_run"]


INPUT_KEYS = ("input_ids", "attention_mask", "response_mask")
TRAIN_KEYS = INPUT_KEYS + (
    "advantages",
    "returns",
    "values",
    "old_log_probs",
    "ref_log_prob",
    "rollout_is_weights",
)


def _inputs(batch: Batch) -> Batch:
    """Only what a forward pass needs travels to the workers."""
    return batch.select(INPUT_KEYS, meta=False)


def _train(batch: Batch) -> Batch:
    return batch.select([k for k in TRAIN_KEYS if k in batch.tensors], meta=False)
