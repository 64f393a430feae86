"""The engine's actor role: `ActorRolloutRef` (policy + rollout + frozen reference); the
critic and the reward model are in `roles.value_models`.

Each role owns its models and optimizer and exposes the stage operations the driver calls
(here generate, compute_log_prob, compute_ref_log_prob, update_actor) and save/load of its
state at an fsspec URL. Batches go in and come out. A role runs on one rank of its group:
in-process (one rank) or inside a Ray worker (`hybrid_engine.pool.pool`), where the group's
ranks train in FSDP2 layout together (`hybrid_engine.models.sharding`). Nothing here knows about storage layout or orchestration.
"""

from __future__ import annotations

import copy
import ctypes
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from hybrid_engine.algorithms.kl import kl_penalty
from hybrid_engine.algorithms.losses import (
    agg_loss,
    band_clip_fractions,
    loss_aggregation,
    policy_loss,
)
from hybrid_engine.batch import Batch
from hybrid_engine.config import HybridConfig
from hybrid_engine.models.loading import load_policy
from hybrid_engine.models.logprobs import (
    packed_response_log_probs,
    response_log_probs,
)
from hybrid_engine.models.lora import adapters_disabled, add_lora, lora_config
from hybrid_engine.models.sharding import (
    RolloutWeights,
    engine_weights,
    full_state_dict,
    is_sharded,
    load_state,
    local_numel,
    save_state,
    shard_model,
    world_size,
)
from hybrid_engine.registry import ROLLOUT_BACKENDS
from hybrid_engine.roles.updates import (
    NonFiniteUpdate,
    make_optimizer,
    micro_batches,
    model_device,
    ppo_updates,
)
from hybrid_engine.rollout.base import RolloutBackend, SamplingParams
from hybrid_engine.staleness import sampled_at
from hybrid_engine.step_metrics import gap_summary

# glibc malloc settings that keep freed memory for reuse: name -> (mallopt option number in
# <malloc.h>, value). The environment variable MALLOC_<name> sets the same when a process starts.
_KEEP_FREED = {"MMAP_MAX_": (-4, 0), "TRIM_THRESHOLD_": (-1, 2**31 - 1), "ARENA_MAX": (-8, 1)}
# how a pool worker of a single-rank group gets them (`pool.Pool.create`)
SYNC_KEYS = itertools.count()  # one per actor role built in this process
REUSE_FREED_MEMORY_ENV = {f"MALLOC_{name}": str(value) for name, (_, value) in _KEEP_FREED.items()}


def reuse_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse: no mmap for large blocks, no trim,
    one arena for all threads.

    By default every tensor above 32 MB is a fresh mmap, so each update page-faults its
    activations and gradients back in: on SmolLM2-135M about 900k faults and 2-3 s of kernel
    time per update. With this, updates from the third step on fault almost nothing and take
    6.0-7.1 s instead of 8.4-10.1 s; the process's peak RSS grows 3.75 -> 4.2 GB (8 demo
    steps). Threads other than the main one get arenas of their own that trim and fault the
    same way; the one-arena limit reaches them only if it is set before any thread has
    allocated, so the CLI calls this first thing. Returns False where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return all(libc.mallopt(option, value) for option, value in _KEEP_FREED.values())


def update_settings(section: Any) -> dict[str, Any]:
    """`ppo_updates`' settings from an actor or critic config section (mini-batches per rank)."""
    return {
        "epochs": section.ppo_epochs,
        "mini_batch_size": section.ppo_mini_batch_size // world_size(),
        "micro_batch_size": section.ppo_micro_batch_size,
        "grad_clip": section.optim.grad_clip,
        "skip_nonfinite": section.skip_nonfinite_steps,
    }


class ActorRolloutRef:
    """Policy in training layout, the rollout engine on its weights, and the reference.

    Training layout: FSDP2 over the group's ranks (a plain module at one rank). Rollout
    layout: full weights per rank. At one rank the rollout module is the training module;
    with FSDP the weights are gathered before each generation and released after it.
    """

    def __init__(
        self, cfg: HybridConfig, tokenizer: PreTrainedTokenizerBase, engines: dict | None = None
    ) -> None:
        self.cfg = cfg
        self.policy = load_policy(cfg.model, tokenizer, cfg.trainer.seed).to(cfg.device)
        lora = cfg.actor.lora
        self.lora = None  # with LoRA the frozen base is the reference: no copy of the weights
        if lora.rank:
            self.lora = lora_config(lora)
            add_lora(self.policy, self.lora, cfg.trainer.seed)
        self.ref = None
        if cfg.use_reference and self.lora is None:
            self.ref = shard_model(copy.deepcopy(self.policy).requires_grad_(False))
        # hf generates from a module in rollout layout; vLLM holds its own copy of the weights
        self.rollout_weights = None
        if ROLLOUT_BACKENDS.info(cfg.rollout.name)["in_place"]:
            self.rollout_weights = RolloutWeights(
                self.policy, cfg.actor.layout.rollout.separate_copy
            )
        shard_model(self.policy)
        if self.rollout_weights is not None:
            self.rollout_weights.bind()
        # The optimizer sees the training layout's parameters that train (this rank's shards).
        params = [p for p in self.policy.parameters() if p.requires_grad]
        steps = cfg.optimizer_steps(cfg.actor)
        self.optimizer, self.scheduler = make_optimizer(params, cfg.actor.optim, steps)
        module = self.rollout_weights.module if self.rollout_weights else self.policy
        self.rollout = make_rollout(cfg, module, tokenizer, engines)
        self.sync_key = next(SYNC_KEYS)  # whose weights a shared engine holds
        self.weights_version = 0
        self.weights_run: str | None = None  # the run whose updates made these weights

    def configure(self, cfg: HybridConfig) -> None:
        """A run's settings that leave models and optimizer as they are."""
        self.cfg = cfg
        self.rollout.configure(cfg)

    # ------------------------------------------------------------------ rollout
    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """Reshard (gather full weights) if needed, generate, release the full weights."""
        if self.rollout_weights is None:  # the backend holds its own copy (vllm)
            return self._generate_pushed(batch, sampling)
        reshard_s = self.rollout_weights.gather(self.weights_version)
        try:
            out = self.rollout.generate(batch, sampling)
        finally:
            self.rollout_weights.release()
        out.meta["reshard_s"] = reshard_s
        return out

    def _generate_pushed(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """Push the weights into the running engine if their version moved, and generate.
        The log-prob gap to the trainer is measured later, on a forward the step runs anyway
        (the advantage stage's old log-probs, or the single on-policy update's own)."""
        metrics: dict[str, float] = {}
        mine = (self.sync_key, self.weights_version)
        # LoRA: merged into the base
        if push_s := self.rollout.sync(mine, lambda: engine_weights(self.policy, self.lora)):
            metrics["timing_s/weight_sync"] = push_s
        out = self.rollout.generate(batch, sampling)
        out.meta["reshard_s"] = metrics.get("timing_s/weight_sync", 0.0)
        out.meta["rollout_metrics"] = metrics
        return out

    # ---------------------------------------------------------------- log-probs
    @property
    def log_probs_fn(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
        """Packed (no padding, shared prompts) or padded log-probs (`actor.pack_prompts`)."""
        return packed_response_log_probs if self.cfg.actor.pack_prompts else response_log_probs

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch) -> Batch:
        """`old_log_probs` and `entropy` of the current policy on the batch's responses."""
        return self._log_probs(self.policy, batch, "old_log_probs", entropy=True)

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        if self.lora is not None:  # the reference is the base: the policy, adapters off
            with adapters_disabled(self.policy):
                return self._log_probs(self.policy, batch, "ref_log_prob", entropy=False)
        if self.ref is None:
            raise RuntimeError("no reference model: set actor.use_kl_loss or use_kl_in_reward")
        return self._log_probs(self.ref, batch, "ref_log_prob", entropy=False)

    def _end_rollout(self) -> None:
        """The training side takes the model: the rollout's prefix cache is freed."""
        self.rollout.end_rollout()

    def _temp(self, batch: Batch) -> float | torch.Tensor:
        """The temperature the batch's tokens were sampled at: per token where the rollout
        recorded it (agent calls at their own), else rollout.temperature (also for stages
        committed before the field existed); greedy (0) gives the model's own log-probs (1)."""
        per_token = batch.tensors.get("response_temperature")
        return per_token if per_token is not None else self.cfg.rollout.temperature or 1.0

    def _log_probs(self, model: nn.Module, batch: Batch, key: str, entropy: bool) -> Batch:
        self._end_rollout()

        def fn(mb: Batch) -> dict[str, torch.Tensor]:
            n = mb["response_mask"].shape[1]
            logp, ent = self.log_probs_fn(
                model, mb["input_ids"], mb["attention_mask"], n, self._temp(mb), entropy
            )
            return {key: logp, "entropy": ent} if entropy else {key: logp}

        return micro_batches(
            batch, self.cfg.actor.log_prob_micro_batch_size, fn, model_device(model)
        )

    # ------------------------------------------------------------------- update
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """Policy update with the registered loss `actor.policy_loss.mode` (+ entropy bonus,
        + KL loss to the reference), each term reduced by its own aggregation."""
        self._end_rollout()
        a = self.cfg.actor
        if a.use_kl_loss and "ref_log_prob" not in batch:
            raise ValueError("actor.use_kl_loss needs ref_log_prob in the batch")
        scale = a.loss_scale_factor or self.cfg.max_response_length
        pg_mode = a.policy_loss.aggregation or a.loss_agg_mode
        pg_agg = loss_aggregation(a.policy_loss.mode, pg_mode)
        gaps: list[torch.Tensor] = []  # |rollout - trainer| log-prob, from this forward
        # measured only before the first optimizer step, on rows sampled at these weights
        on_policy = sampled_at(batch.tensors.get("weights_version"), self.weights_version)
        first = self.scheduler.last_epoch if on_policy else None

        def loss_fn(micro: Batch, small: Batch, keep: int) -> tuple[list, dict]:
            mask = small["response_mask"]
            logp, ent = self.log_probs_fn(
                self.policy,
                small["input_ids"],
                small["attention_mask"],
                keep,
                self._temp(small),
                True,
            )
            # Without stored old log-probs the data is on-policy (see Engine).
            old = micro.tensors.get("old_log_probs")
            sampled = micro.tensors.get("rollout_log_probs")  # the gap, where unmeasured yet:
            if old is None and sampled is not None and self.scheduler.last_epoch == first:
                gaps.append((sampled[:, :keep] - logp.detach()).abs()[mask.bool()])
            old = logp.detach() if old is None else old[:, :keep]
            is_weights = micro.tensors.get("rollout_is_weights")
            pg, clipfrac, ppo_kl, clip_lower = policy_loss(
                old,
                logp,
                micro["advantages"][:, :keep],
                mask,
                clip_ratio_low=a.clip_ratio_low,
                clip_ratio_high=a.clip_ratio_high,
                clip_ratio_c=a.clip_ratio_c,
                loss_agg_mode=pg_mode,
                loss_mode=a.policy_loss.mode,
                rollout_is_weights=None if is_weights is None else is_weights[:, :keep],
                tau_pos=a.policy_loss.tau_pos,
                tau_neg=a.policy_loss.tau_neg,
                loss_scale_factor=scale,
            )
            low, high = band_clip_fractions(
                old, logp, micro["advantages"][:, :keep], mask, a.clip_ratio_low, a.clip_ratio_high
            )
            entropy = agg_loss(ent, mask, a.loss_agg_mode, scale)
            parts = [(pg, pg_agg)]
            if a.entropy_coeff:  # with no bonus the entropy is a metric only: no backward
                parts.append((-a.entropy_coeff * entropy, a.loss_agg_mode))
            stats = {
                "actor/pg_loss": pg,
                "actor/pg_clipfrac": clipfrac,
                "actor/pg_clipfrac_lower": clip_lower,
                "actor/pg_clipfrac_low": low,  # the band by side (TRL's clip_ratio/low, high)
                "actor/pg_clipfrac_high": high,
                "actor/ppo_kl": ppo_kl,
                "actor/entropy": entropy,
            }
            if a.use_kl_loss:
                kl = kl_penalty(logp, micro["ref_log_prob"][:, :keep], a.kl_loss_type)
                stats["actor/kl_loss"] = agg_loss(kl, mask, a.loss_agg_mode, scale)
                parts.append((a.kl_loss_coef * stats["actor/kl_loss"], a.loss_agg_mode))
            return parts, stats

        try:
            metrics = ppo_updates(
                self.policy,
                self.optimizer,
                self.scheduler,
                batch,
                loss_fn,
                prefix="actor",
                **update_settings(a),
            )
        except NonFiniteUpdate as e:
            step = self.weights_version + 1
            self.invalidate()
            raise NonFiniteUpdate(f"step {step}: {e}", e.stepped) from None
        self.weights_version += 1
        self.weights_run = self.cfg.trainer.run_id
        return metrics | gap_summary(gaps)

    def invalidate(self) -> None:
        """Mark these weights as no version at all (a refused update may have moved them, or
        the critic's): whoever resumes reloads the last checkpoint instead of re-attaching."""
        self.weights_version = -1

    # -------------------------------------------------------------------- state
    def save(self, url: str, storage_options: dict | None = None) -> dict[str, str]:
        """Weights, optimizer, scheduler and RNG state under `url` (all ranks call it);
        returns {file name: sha256} of what this rank wrote."""
        extra = {"weights_version": self.weights_version, "weights_run": self.weights_run}
        return save_state(
            url,
            self.policy,
            self.optimizer,
            self.scheduler,
            extra,
            storage_options,
            trainable_only=self.lora is not None,
        )

    def load(
        self, url: str, storage_options: dict | None = None, expected: dict | None = None
    ) -> int:
        """Restore what `save` wrote (checked against `expected` sha256 sums when given);
        returns the restored weights version."""
        self._end_rollout()
        extra = load_state(
            url,
            self.policy,
            self.optimizer,
            self.scheduler,
            storage_options,
            expected,
            trainable_only=self.lora is not None,
        )
        self.weights_version = int(extra["weights_version"])
        self.weights_run = extra.get("weights_run")
        (self.rollout_weights or self.rollout).synced_version = -1  # the rollout syncs again
        return self.weights_version

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full weights on rank 0 ({} elsewhere), with LoRA's adapter tensors
        beside the base layers they adapt; all ranks must call it."""
        return full_state_dict(self.policy)

    def replica_state_dict(self) -> dict[str, torch.Tensor]:
        """What a rollout replica loads to hold these weights (`pool.replica`): the full
        weights, or with LoRA the adapters alone (the replica builds the same frozen base)."""
        return full_state_dict(self.policy, trainable_only=self.lora is not None)

    def rollout_progress(self) -> dict[str, float] | None:
        """The generate call running now: response tokens so far and seconds (hf only)."""
        return self.rollout.progress()

    def info(self) -> dict:
        rw = self.rollout_weights
        return {
            "weights_version": self.weights_version,
            "weights_run": self.weights_run,
            "sharded": is_sharded(self.policy),
            "local_params": local_numel(self.policy),
            "trainable_params": sum(p.numel() for p in self.policy.parameters() if p.requires_grad),
            "rollout_shares_storage": bool(rw and rw.shares_storage),
            "last_reshard_s": rw.gather_seconds if rw else None,
        }


def make_rollout(
    cfg: HybridConfig, module: nn.Module, tokenizer: PreTrainedTokenizerBase, engines: dict | None
) -> RolloutBackend:
    """The rollout backend registered as `rollout.name`, built for this policy; a backend
    with an engine of its own (vllm) takes a running one from `engines` where it fits."""
    backend = ROLLOUT_BACKENDS[cfg.rollout.name]
    if engines is None or ROLLOUT_BACKENDS.info(cfg.rollout.name)["in_place"]:
        return backend.build(cfg, module, tokenizer)
    return backend.build(cfg, module, tokenizer, engines=engines)
