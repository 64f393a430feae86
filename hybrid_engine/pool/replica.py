"""A rollout replica: generation in its own process, on weights the trainer sends it.

With `ray.rollout=separate` (what `trainer.max_staleness > 0` picks) the pool has a
`rollout` group beside the actor group. Its ranks hold a plain copy of the policy in rollout
layout (full weights, no optimizer, no reference) and generate while the trainer trains:

    trainer (actor group)                         rollout group
    publish: weights of version v       ──ray──▶  receive(v): load them in place
    update(N) ...                                 generate(step N+k) with version v

The weights travel through Ray's object store: rank 0 of the actor group gathers the FSDP
shards and puts one copy there (`publish`), each replica reads it (`receive`). With LoRA only
the adapters travel: a replica builds the frozen base as the trainer does, from `model.path`. A replica
knows which version it holds; the driver decides which version each rollout must use.

With `rollout.name: vllm` the replica's copy feeds a vLLM engine that the replica owns (as
the actor role does when colocated): `receive` loads the version into the copy, and the next
`generate` pushes it into the running engine (with LoRA, merged into the base).
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedTokenizerBase

from hybrid_engine.batch import Batch
from hybrid_engine.config import HybridConfig
from hybrid_engine.models.loading import load_policy
from hybrid_engine.models.lora import add_lora, lora_config
from hybrid_engine.models.sharding import engine_weights
from hybrid_engine.roles.workers import SYNC_KEYS, make_rollout
from hybrid_engine.rollout.base import SamplingParams


class RolloutReplica:
    """Generation only: the policy's architecture, the trainer's weights of one version."""

    def __init__(
        self, cfg: HybridConfig, tokenizer: PreTrainedTokenizerBase, engines: dict | None = None
    ) -> None:
        self.cfg = cfg
        self.policy = load_policy(cfg.model, tokenizer, cfg.trainer.seed).to(cfg.device)
        self.lora = None
        if cfg.actor.lora.rank:  # the trainer's state dict holds the adapters beside the base
            self.lora = lora_config(cfg.actor.lora)
            add_lora(self.policy, self.lora, cfg.trainer.seed)
        self.policy.requires_grad_(False)
        self.rollout = make_rollout(cfg, self.policy, tokenizer, engines)
        self.sync_key = next(SYNC_KEYS)  # whose weights a shared engine holds
        self.weights_version = -1  # none received yet: the first rollout loads version 0 too

    def configure(self, cfg: HybridConfig) -> None:
        self.cfg = cfg
        self.rollout.configure(cfg)

    @torch.no_grad()
    def receive(self, state: dict[str, torch.Tensor], version: int) -> float:
        """Load the trainer's weights of `version` in place (with LoRA: the adapters); returns
        the seconds."""
        start = time.perf_counter()
        self.rollout.end_rollout()
        missing, unexpected = self.policy.load_state_dict(state, strict=False)
        if self.cfg.actor.lora.rank:
            missing = [k for k in missing if ".lora_" in k]  # the base is the replica's own
        if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
            raise RuntimeError(
                f"weights of version {version} do not fit the rollout replica: missing "
                f"{missing[:3]}, unexpected {unexpected[:3]}"
            )
        self.weights_version = version
        return time.perf_counter() - start

    def invalidate(self) -> None:
        """Hold no known version: the next rollout loads the one it needs."""
        self.weights_version = -1

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """Generate on the version received; an engine of its own (vllm) gets it pushed first
        where it holds another (after `receive`, or a fresh engine after one died)."""
        mine = (self.sync_key, self.weights_version)
        push_s = self.rollout.sync(mine, lambda: engine_weights(self.policy, self.lora))
        out = self.rollout.generate(batch, sampling)
        out.meta["reshard_s"] = push_s
        if push_s:
            out.meta["rollout_metrics"] = {"timing_s/weight_sync": push_s}
        return out

    def rollout_progress(self) -> dict[str, float] | None:
        return self.rollout.progress()

    def info(self) -> dict:
        return {"weights_version": self.weights_version}
