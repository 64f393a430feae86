"""The driver: one training step as four calls (the plain loop around them: `loop.train`).

    batch = engine.rollout(step)      # prompts -> n sampled responses each
    batch = engine.reward(batch)      # responses -> token-level scores
    batch = engine.advantage(batch)   # old/ref log-probs, values, KL, advantages
    result = engine.update(batch)     # critic then actor update; weights version += 1

Every stage takes and returns a `Batch`; its metrics travel in `batch.meta["metrics"]`.
The Prefect tasks call exactly these four methods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybrid_engine.algorithms.advantages import compute_advantage
from hybrid_engine.algorithms.correction import rollout_correction
from hybrid_engine.algorithms.kl import apply_kl_penalty, kl_controller
from hybrid_engine.algorithms.utils import masked_mean
from hybrid_engine.batch import Batch
from hybrid_engine.config import HybridConfig
from hybrid_engine.data import PromptData, prompt_batch
from hybrid_engine.evaluation import validate
from hybrid_engine.export import policy_module
from hybrid_engine.models.loading import load_tokenizer, set_determinism
from hybrid_engine.roles.value_models import Critic, RewardModel
from hybrid_engine.roles.workers import ActorRolloutRef, reuse_freed_memory
from hybrid_engine.rollout.agent.runner import EpisodeLog, agent_rollout
from hybrid_engine.rollout.base import SamplingParams, step_seed
from hybrid_engine.rollout.dynamic_sampling import dynamic_rollout
from hybrid_engine.rollout.multiturn import env_rollout, multi_turn_metrics
from hybrid_engine.scoring import BatchScoring
from hybrid_engine.staleness import WeightsFeed, rollout_version, sampled_at, staleness_metrics
from hybrid_engine.step_metrics import (
    batch_stats,
    finish_step,
    gap_metrics,
    rollout_timings,
    timer,
)


class Engine:
    """Holds the roles (actor/rollout/ref, critic, reward model), the data and the scorer.

    `trainer.backend: local` builds the roles in this process (one rank); `ray` serves them
    from the persistent pool (`hybrid_engine.pool.pool`), whose proxies have the same methods.
    A warm pool is reset to fresh weights unless `reset_pool=False` (resuming a run).
    """

    def __init__(self, cfg: HybridConfig, reset_pool: bool = True) -> None:
        self.cfg = cfg
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        set_determinism(cfg.trainer.deterministic, cfg.device)
        if cfg.trainer.reuse_freed_memory:
            reuse_freed_memory()
        self.tokenizer = load_tokenizer(cfg.model)
        self.data = PromptData(cfg.data)
        self.scoring = BatchScoring(cfg, self.tokenizer)
        self.pool = None
        self.feed: WeightsFeed | None = None  # the trainer's weights to a separate rollout group
        self.critic: Critic | None = None
        self.reward_model: RewardModel | None = None
        if cfg.trainer.backend == "ray":
            from hybrid_engine.pool.pool import Pool

            self._use_pool(Pool.up(cfg))
            if reset_pool and not self.pool.created and self.actor.weights_version != 0:
                self.pool.reset()
        else:
            self.actor = ActorRolloutRef(cfg, self.tokenizer)
            if cfg.use_critic:
                self.critic = Critic(cfg, self.tokenizer)
            if cfg.use_reward_model:
                self.reward_model = self.scoring.reward_model = RewardModel(cfg, self.tokenizer)
        self.kl_ctrl = kl_controller(**cfg.algorithm.kl_ctrl.model_dump())
        self.next_gen_batch, self.kept_of_prompts = 1, None  # the plain loop's DAPO cursor

    def _use_pool(self, pool: Any) -> None:
        self.pool = pool
        self.actor = pool.role("actor")
        if self.cfg.use_critic:
            self.critic = pool.role("critic")
        if self.cfg.use_reward_model:
            self.reward_model = self.scoring.reward_model = pool.role("rm")
        if self.cfg.separate_rollout:
            replicas = pool.role("rollout")
            self.feed = WeightsFeed(self.actor, replicas, self.cfg.trainer.max_staleness)

    @property
    def generator(self) -> Any:
        """Who generates the training rollouts: the actor, or the separate rollout group."""
        return self.actor if self.feed is None else self.feed.replicas

    def recreate_pool(self) -> list[str]:
        """After a worker died or hung: tear the pool down and create it again with the same
        spec (fresh weights, version 0: the caller restores the run's state). Returns the
        names of the workers removed."""
        from hybrid_engine.pool.pool import Pool

        removed, claim = self.pool.teardown(), self.pool.claim
        self._use_pool(Pool.up(self.cfg))
        self.pool.hold(claim)
        return removed

    def reset_weights(self) -> None:
        """Fresh weights, optimizers and KL coefficient, as a new run starts with."""
        if self.pool is not None:
            self.pool.reset()
        else:
            self.actor = ActorRolloutRef(self.cfg, self.tokenizer)
            if self.critic is not None:
                self.critic = Critic(self.cfg, self.tokenizer)
        self.kl_ctrl = kl_controller(**self.cfg.algorithm.kl_ctrl.model_dump())

    def rollout_progress(self) -> dict[str, float] | None:
        """While `rollout` runs (hf backend): response tokens sampled so far and seconds."""
        return self.generator.rollout_progress()

    def publish_weights(self) -> None:
        """Asynchronous training: the weights the trainer holds now, for the rollouts that
        are to use them (`hybrid_engine.staleness`); nothing to do when generation is
        colocated."""
        if self.feed is not None:
            self.feed.publish()

    def forget_rollout_weights(self) -> None:
        """Before a restore: the replicas may hold another run's (or lineage's) version of
        the same number; the next rollout loads its own."""
        if self.feed is not None:
            self.feed.clear()
            self.generator.invalidate()

    def _rollout_weights(self, step: int, metrics: dict[str, float]) -> int:
        """The weights version step N's rollout generates with, given to the generator."""
        if self.feed is None:
            return self.actor.weights_version
        version = rollout_version(step, self.cfg.trainer.max_staleness)
        metrics |= self.feed.feed(version)
        return version

    # -------------------------------------------------------------- 1. rollout
    def sample(
        self,
        step: int,
        first_gen_batch: int | None = None,
        load: Callable[[int], Batch | None] | None = None,
        save: Callable[[int, Batch], None] | None = None,
        on_turn: Callable[[int], None] | None = None,
        prior: Sequence[int] | None = None,
    ) -> Batch:
        """The rollout stage of step N: `rollout(N)`, or with `algorithm.filter_groups` the
        DAPO rounds from `first_gen_batch`, the first sized by `prior` (default: where the last
        step this engine ran ended, and its rate), scored on the way (`dynamic_sampling`)."""
        fg, cfg = self.cfg.algorithm.filter_groups, self.cfg
        if not fg.enabled:
            return self.rollout(step, on_turn=on_turn)
        if first_gen_batch is None:
            first_gen_batch, prior = self.next_gen_batch, self.kept_of_prompts
        batch = dynamic_rollout(
            lambda g, n: self.reward(self.rollout(step, g, on_turn, n_prompts=n)),
            first_gen_batch=first_gen_batch,
            groups=cfg.data.train_batch_size,
            metric=fg.metric,
            max_num_gen_batches=fg.max_num_gen_batches,
            on_exhausted=fg.on_exhausted,
            pad_token_id=self.tokenizer.pad_token_id,
            adaptive=fg.adaptive_rounds,
            cap=max(cfg.data.train_batch_size, cfg.rollout.micro_batch_size // cfg.rollout.n),
            load=load,
            save=save,
            prior=prior,
        )
        self.next_gen_batch = batch.meta["next_gen_batch"]
        self.kept_of_prompts = batch.meta["kept_of_prompts"]
        batch.meta["step"] = step
        return batch

    def rollout(
        self,
        step: int,
        gen_batch: int | None = None,
        on_turn: Callable[[int], None] | None = None,
        episode_log: EpisodeLog | None = None,
        n_prompts: int | None = None,
    ) -> Batch:
        """Step N's prompts, `rollout.n` samples each (multi-turn: trajectories, `on_turn(k)`
        called after turn k; agents: episodes, each handed to `episode_log` as it ends and
        `on_turn(k)` called after the k-th). Generation batch g (dynamic sampling) takes the
        prompts and seed step g takes without it, default g = N; `n_prompts`: that many
        prompts of the data order from the start of batch g (fewer than a batch: its first
        ones, sampled as in the whole batch; more: on into the next batches), with g's seed."""
        r = self.cfg.rollout
        g = step if gen_batch is None else gen_batch
        metrics: dict[str, float] = {}
        version = self._rollout_weights(step, metrics)
        b = self.cfg.data.train_batch_size
        n = n_prompts or b
        rows = [row for k in range(g, g + -(-n // b)) for row in self.data.step_rows(k)][:n]
        prompts = prompt_batch(rows, self.tokenizer, self.cfg.data.max_prompt_length)
        prompts["uid"] = [f"{g + i // b}-{i % b}" for i in range(n)]
        sampling = SamplingParams(
            r.max_new_tokens,
            r.temperature,
            r.top_p,
            r.top_k,
            step_seed(self.cfg.trainer.seed, g),
            log_probs=self.cfg.rollout_log_probs,
        )
        with timer(metrics, "gen"):
            batch = self.generate(
                prompts.repeat_interleave(r.n),
                sampling,
                on_turn,
                self.generator,
                version,
                episode_log,
            )
        batch["weights_version"] = torch.full((len(batch),), version, dtype=torch.long)
        metrics |= rollout_timings(batch.meta)
        if "agent_fault" in batch:
            metrics |= multi_turn_metrics(batch, "agent/", ("done", "fault"))
            metrics |= batch.meta["agent_metrics"]
        elif "turns" in batch:
            metrics |= multi_turn_metrics(batch)
            metrics["timing_s/env"] = batch.meta["env_seconds"]
        if self.cfg.greedy_baseline:
            with timer(metrics, "gen_baseline"):
                greedy = self.generator.generate(prompts, SamplingParams(r.max_new_tokens, 0.0))
            greedy = greedy.repeat_interleave(r.n)
            batch["baseline_response_ids"] = greedy["response_ids"]
            batch["baseline_response_mask"] = greedy["response_mask"]
        metrics["perf/tokens_per_s_rollout"] = batch.meta["gen_tokens_per_s"]
        batch.meta.update(step=step, metrics=metrics)
        return batch

    def generate(
        self,
        prompts: Batch,
        sampling: SamplingParams,
        on_turn: Callable[[int], None] | None = None,
        role: Any = None,
        version: int | None = None,
        episode_log: EpisodeLog | None = None,
    ) -> Batch:
        """One sample per prompt row: a response, with multi-turn a trajectory, with an agent
        an episode (one or more sequences); generated by `role` (default: the trainer's own
        weights, as validation needs), whose weights have `version`."""
        mt, agent = self.cfg.rollout.multi_turn, self.cfg.rollout.agent
        generate = (role or self.actor).generate
        if agent.function:
            if version is None:
                version = self.actor.weights_version
            return agent_rollout(
                generate, self.tokenizer, prompts, sampling, agent, version, episode_log, on_turn
            )
        if not mt.enabled:
            return generate(prompts, sampling)
        max_prompt = self.cfg.data.max_prompt_length
        return env_rollout(generate, self.tokenizer, prompts, sampling, mt, max_prompt, on_turn)

    # --------------------------------------------------------------- 2. reward
    def reward(self, batch: Batch) -> Batch:
        """`scores`, `acc` (score >= 1) and `token_level_scores` (`scoring.BatchScoring`)."""
        return self.scoring.reward(batch)

    # ------------------------------------------------------------ 3. advantage
    def advantage(self, batch: Batch) -> Batch:
        cfg, alg = self.cfg, self.cfg.algorithm
        metrics: dict[str, float] = {}
        if not cfg.on_policy_single_update or len(batch) > cfg.actor.ppo_mini_batch_size:
            with timer(metrics, "old_log_prob"):
                batch = batch.union(self.actor.compute_log_prob(batch))
            if "rollout_log_probs" in batch and sampled_at(
                batch.tensors.get("weights_version"), self.actor.weights_version
            ):  # engine vs trainer
                lps = batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"]
                metrics |= gap_metrics(*lps)
        if cfg.use_reference:
            with timer(metrics, "ref"):
                batch = batch.union(self.actor.compute_ref_log_prob(batch))
        if self.critic is not None:
            with timer(metrics, "values"):
                batch = batch.union(self.critic.compute_values(batch))
        if self.feed is not None and "weights_version" in batch:  # asynchronous: how stale
            metrics |= staleness_metrics(
                batch["weights_version"],
                self.actor.weights_version,
                cfg.trainer.max_staleness,
                batch.meta.get("step"),
            )
        with timer(metrics, "adv"):
            mask = batch["response_mask"]
            if alg.use_kl_in_reward:
                rewards, kl = apply_kl_penalty(
                    batch["token_level_scores"],
                    batch["old_log_probs"],
                    batch["ref_log_prob"],
                    mask,
                    self.kl_ctrl.value,
                    alg.kl_penalty,
                )
                metrics["actor/reward_kl_penalty"] = float(kl)
                metrics["actor/reward_kl_penalty_coeff"] = self.kl_ctrl.value
                self.kl_ctrl.update(float(kl), cfg.data.train_batch_size)
            else:
                rewards = batch["token_level_scores"]
            if alg.rollout_correction.enabled:
                mask = self._correct(batch, metrics)
            adv, ret = compute_advantage(
                alg.adv_estimator,
                token_level_rewards=rewards,
                response_mask=mask,
                index=batch["uid"],
                values=batch.tensors.get("values"),
                reward_baselines=batch.tensors.get("reward_baselines"),
                gamma=alg.gamma,
                lam=alg.lam,
                norm_by_std=alg.norm_adv_by_std_in_grpo,
            )
        batch["token_level_rewards"] = rewards
        batch["advantages"] = adv
        batch["returns"] = ret
        metrics["critic/rewards/mean"] = float(rewards.sum(-1).mean())
        metrics["critic/advantages/mean"] = float(masked_mean(adv, mask))
        metrics["critic/returns/mean"] = float(masked_mean(ret, mask))
        batch.meta["metrics"] = {**batch.meta.get("metrics", {}), **metrics}
        return batch

    def _correct(self, batch: Batch, metrics: dict[str, float]) -> torch.Tensor:
        """Rollout correction: IS weights into the batch, rejected tokens out of its mask."""
        rc = self.cfg.algorithm.rollout_correction
        if "rollout_log_probs" not in batch:
            raise ValueError(
                "algorithm.rollout_correction needs the rollout's own log-probs "
                "(rollout_log_probs), which this rollout did not record"
            )
        weights, mask, m = rollout_correction(
            batch["old_log_probs"],
            batch["rollout_log_probs"],
            batch["response_mask"],
            rc.level,
            rc.threshold,
            rc.batch_normalize,
            rc.rejection_modes,
            rc.rejection_thresholds,
        )
        if weights is not None:
            batch["rollout_is_weights"] = weights
        batch["response_mask"] = mask
        metrics |= m
        return mask

    # --------------------------------------------------------------- 4. update
    def update(self, batch: Batch) -> Batch:
        """Critic first, then actor. Returns an empty batch whose meta holds the metrics."""
        metrics: dict[str, float] = {}
        if self.critic is not None:
            try:
                with timer(metrics, "update_critic"):
                    metrics |= self.critic.update_critic(batch)
            except FloatingPointError:  # a refused critic update (NonFiniteUpdate)
                self.actor.invalidate()  # resume from the checkpoint, the critic too
                raise
        with timer(metrics, "update_actor"):
            metrics |= self.actor.update_actor(batch)
        metrics["weights_version"] = self.actor.weights_version
        if self.pool is not None:  # each worker's memory, as `hybridrl pool status` shows it
            metrics |= self.pool.memory_metrics("update")
        metrics |= batch_stats(batch, self.cfg.max_response_length)
        metrics = {**batch.meta.get("metrics", {}), **metrics}
        return Batch(meta={"step": batch.meta.get("step"), "metrics": metrics})

    def export(self) -> tuple[torch.nn.Module, dict[str, torch.Tensor] | None]:
        """The current policy as a plain HF module here (`export.policy_module`)."""
        return policy_module(self.cfg, self.actor, self.tokenizer)

    # ----------------------------------------------------------------- driver
    def step(self, step: int) -> dict[str, float]:
        """One full step; returns its metrics."""
        start = time.perf_counter()
        result = self.update(self.advantage(self.reward(self.sample(step))))
        return finish_step(result.meta["metrics"], time.perf_counter() - start)

    def validate(self, samples: int = 0) -> dict[str, Any]:
        """Greedy (by default) generation on the held-out rows (`evaluation.validate`)."""
        return validate(self, samples)
