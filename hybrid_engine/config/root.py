"""`HybridConfig`: the whole run as one pydantic-settings model, and the checks that span
sections (batch sizes, layouts, what the chosen estimator and loss need)."""

from __future__ import annotations

import contextvars
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from hybrid_engine.config.base import reads
from hybrid_engine.config.infra import (
    PipelineConfig,
    RayConfig,
    RegistryConfig,
    StorageConfig,
    TrackingConfig,
    TrainerConfig,
    no_credentials_in_url,
)
from hybrid_engine.config.training import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    ModelConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    import_plugins,
)
from hybrid_engine.registry import ROLLOUT_BACKENDS, estimator_needs


class HybridConfig(BaseSettings):
    """The whole run. Sections mirror the pipeline's parts."""

    model_config = SettingsConfigDict(
        env_prefix="HYBRIDRL_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        nested_model_default_partial_update=True,
    )

    data: DataConfig = Field(default_factory=DataConfig, json_schema_extra=reads("run"))
    model: ModelConfig = Field(default_factory=ModelConfig, json_schema_extra=reads("run"))
    actor: ActorConfig = Field(default_factory=ActorConfig, json_schema_extra=reads("update"))
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, json_schema_extra=reads("rollout")
    )
    ref: RefConfig = Field(default_factory=RefConfig, json_schema_extra=reads("advantage"))
    critic: CriticConfig = Field(default_factory=CriticConfig, json_schema_extra=reads("update"))
    reward: RewardConfig = Field(default_factory=RewardConfig, json_schema_extra=reads("reward"))
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, json_schema_extra=reads("advantage")
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    ray: RayConfig = Field(default_factory=RayConfig, json_schema_extra=reads("where"))
    storage: StorageConfig = Field(default_factory=StorageConfig, json_schema_extra=reads("where"))
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig, json_schema_extra=reads("where")
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, json_schema_extra=reads("where")
    )
    registry: RegistryConfig = Field(
        default_factory=RegistryConfig, json_schema_extra=reads("where")
    )

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: Any) -> Any:
        """Register the plugins' estimators and losses before any name is checked."""
        plugins = data.get("algorithm", {}).get("plugins") if isinstance(data, dict) else None
        if isinstance(plugins, list):
            import_plugins([str(m) for m in plugins])
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_credentials_in_urls(cls, data: Any) -> Any:
        """URLs that would carry a secret into every record of the run (storage checks its
        own, with its key names)."""
        if isinstance(data, dict):
            for section, key in (("tracking", "uri"), ("ray", "address")):
                part = data.get(section)
                if isinstance(part, dict):
                    no_credentials_in_url(f"{section}.{key}", part.get(key))
        return data

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls))

    # ------------------------------------------------------------ derived facts
    @property
    def estimator_needs(self) -> frozenset[str]:
        """What the estimator requires (from its registered signature): "values" (a
        critic), "index" (prompt groups), "reward_baselines" (a greedy rollout)."""
        return estimator_needs(self.algorithm.adv_estimator)

    @property
    def use_critic(self) -> bool:
        return "values" in self.estimator_needs

    @property
    def greedy_baseline(self) -> bool:
        """Each prompt also gets a greedy rollout whose reward is the baseline (ReMax)."""
        return "reward_baselines" in self.estimator_needs

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def samples_per_step(self) -> int:
        return self.data.train_batch_size * self.rollout.n

    def optimizer_steps(self, role: Any) -> int:
        """A role's (actor or critic section) optimizer steps over the run: the length of
        its LR schedule (trainer steps x mini-batches x epochs)."""
        minis = -(-self.samples_per_step // role.ppo_mini_batch_size)
        return self.trainer.total_training_steps * minis * role.ppo_epochs

    @property
    def on_policy_single_update(self) -> bool:
        """One optimizer step on data from the current weights: the old log-probs equal the
        new ones before that step, so the update takes them from its own forward pass
        (detached) instead of a separate one. KL-in-reward still needs them up front."""
        a = self.actor
        return (
            a.ppo_epochs == 1
            and a.ppo_mini_batch_size == self.samples_per_step
            and not self.algorithm.use_kl_in_reward
            and not self.algorithm.rollout_correction.enabled
        )

    @property
    def device(self) -> str:
        """Where the workers' models live: GPUs when the pool reserves them, else the CPU."""
        gpu = self.trainer.backend == "ray" and self.ray.num_gpus_per_rank > 0
        return "cuda" if gpu else "cpu"

    @property
    def max_response_length(self) -> int:
        """The widest response a rollout returns: rollout.max_new_tokens, or with multi-turn
        rollout.multi_turn.max_total_tokens (assistant and observation tokens)."""
        mt, agent = self.rollout.multi_turn, self.rollout.agent
        if agent.function:
            return agent.max_context_tokens + self.rollout.max_new_tokens
        return mt.max_total_tokens if mt.enabled else self.rollout.max_new_tokens

    @property
    def use_reward_model(self) -> bool:
        return self.reward.model_path is not None

    @property
    def rollout_log_probs(self) -> bool:
        """Rollouts record their sampling log-probs: rollout correction reads them, and a
        backend with a weights copy of its own (vllm) is checked against the trainer."""
        own = not ROLLOUT_BACKENDS.info(self.rollout.name)["in_place"]
        return self.algorithm.rollout_correction.enabled or own

    @property
    def separate_rollout(self) -> bool:
        """Generation runs in its own pool group (`ray.rollout=separate`)."""
        return self.trainer.backend == "ray" and self.ray.rollout == "separate"

    @model_validator(mode="after")
    def _asynchronous(self) -> HybridConfig:
        """trainer.max_staleness > 0 picks what it needs: generation in its own processes
        (the pool, a separate rollout group) and rollout correction of the stale samples."""
        if not self.trainer.max_staleness:
            return self
        k = f"trainer.max_staleness={self.trainer.max_staleness}"
        fg = self.algorithm.filter_groups.enabled
        if fg and self.reward.model_path is not None and self.ray.reward_model == "colocated":
            raise ValueError(
                f"{k} with algorithm.filter_groups and a reward model: dynamic "
                "sampling scores while the trainer runs; set "
                "ray.reward_model=separate"
            )
        self.trainer.backend = "ray"
        self.ray.rollout = "separate"
        if not self.algorithm.rollout_correction.enabled:
            self.algorithm.rollout_correction.level = "token"
        return self

    @model_validator(mode="after")
    def _check_batch_sizes(self) -> HybridConfig:
        n = self.samples_per_step
        checks = [
            (
                "actor.ppo_mini_batch_size",
                self.actor.ppo_mini_batch_size,
                n,
                "data.train_batch_size * rollout.n",
            ),
            (
                "actor.ppo_micro_batch_size",
                self.actor.ppo_micro_batch_size,
                self.actor.ppo_mini_batch_size,
                "actor.ppo_mini_batch_size",
            ),
        ]
        if self.use_critic:
            checks += [
                (
                    "critic.ppo_mini_batch_size",
                    self.critic.ppo_mini_batch_size,
                    n,
                    "data.train_batch_size * rollout.n",
                ),
                (
                    "critic.ppo_micro_batch_size",
                    self.critic.ppo_micro_batch_size,
                    self.critic.ppo_mini_batch_size,
                    "critic.ppo_mini_batch_size",
                ),
            ]
        for key, size, total, total_name in checks:
            if size > total or total % size:
                raise ValueError(
                    f"{key}={size} must divide {total_name}={total} "
                    f"(data.train_batch_size={self.data.train_batch_size}, rollout.n={self.rollout.n})"
                )
        if self.reward.overlong_buffer_len >= self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer_len={self.reward.overlong_buffer_len} must be smaller "
                f"than rollout.max_new_tokens={self.rollout.max_new_tokens}"
            )
        mt = self.rollout.multi_turn
        if mt.enabled and self.reward.overlong_buffer_len:
            raise ValueError(
                f"reward.overlong_buffer_len={self.reward.overlong_buffer_len} with "
                "rollout.multi_turn.enabled: the overlong penalty counts one response's tokens; "
                "set it to 0 (rollout.multi_turn.max_total_tokens bounds a trajectory)"
            )
        agent = self.rollout.agent
        if agent.function and mt.enabled:
            raise ValueError(
                f"rollout.agent.function={agent.function!r} with rollout.multi_turn.enabled: "
                "an agent runs its own conversation; turn one of them off"
            )
        if agent.function and (self.greedy_baseline or self.reward.overlong_buffer_len):
            raise ValueError(
                f"rollout.agent.function={agent.function!r}: agent episodes have no single "
                "response for a greedy baseline or reward.overlong_buffer_len to measure"
            )
        if agent.function and self.algorithm.filter_groups.enabled:
            raise ValueError(
                f"rollout.agent.function={agent.function!r} with algorithm.filter_groups: "
                "dynamic sampling over agent episodes is not supported yet"
            )
        if mt.enabled and self.greedy_baseline:
            raise ValueError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs a greedy "
                "single-turn baseline rollout, which multi-turn rollouts do not make"
            )
        if self.algorithm.filter_groups.enabled and self.rollout.n < 2:
            raise ValueError(
                f"rollout.n={self.rollout.n}: algorithm.filter_groups keeps prompt groups whose "
                "samples disagree, it needs rollout.n >= 2"
            )
        if "index" in self.estimator_needs and self.rollout.n < 2:
            raise ValueError(
                f"rollout.n={self.rollout.n}: {self.algorithm.adv_estimator} compares samples "
                "of one prompt, it needs rollout.n >= 2"
            )
        return self

    @model_validator(mode="after")
    def _check_layout(self) -> HybridConfig:
        """What each layout setting needs; what this build cannot run is refused by name."""
        lay, backend = self.actor.layout, self.trainer.backend
        ranks = {"actor.layout.dp": lay.dp}
        if self.use_critic and self.ray.critic == "separate":
            ranks["ray.critic_dp"] = self.ray.critic_dp
        if self.use_reward_model and self.ray.reward_model == "separate":
            ranks["ray.reward_model_dp"] = self.ray.reward_model_dp
        if backend == "local":
            many = {k: v for k, v in ranks.items() if v > 1}
            if many:
                raise ValueError(
                    f"{_kv(many)}: the local backend runs one rank in this process; "
                    "set trainer.backend=ray for data-parallel ranks"
                )
            if "separate" in (self.ray.critic, self.ray.reward_model, self.ray.rollout):
                raise ValueError(
                    "ray.critic / ray.reward_model / ray.rollout = separate need "
                    "trainer.backend=ray"
                )
        n = self.samples_per_step
        for key, group_dp, size in [
            ("actor.ppo_mini_batch_size", lay.dp, self.actor.ppo_mini_batch_size),
            (
                "critic.ppo_mini_batch_size",
                ranks.get("ray.critic_dp", lay.dp),
                self.critic.ppo_mini_batch_size,
            ),
        ]:
            if key.startswith("critic") and not self.use_critic:
                continue
            if size % group_dp or n % group_dp:
                raise ValueError(
                    f"{key}={size} and the {n} samples of a step must split evenly over "
                    f"{group_dp} data-parallel ranks"
                )
        per_rank = [
            ("actor", lay.dp, self.actor.ppo_mini_batch_size, self.actor.ppo_micro_batch_size)
        ]
        if self.use_critic:
            c = self.critic
            per_rank.append(
                (
                    "critic",
                    ranks.get("ray.critic_dp", lay.dp),
                    c.ppo_mini_batch_size,
                    c.ppo_micro_batch_size,
                )
            )
        for role, group_dp, mini, micro in per_rank:
            if (mini // group_dp) % micro:
                raise ValueError(
                    f"{role}.ppo_micro_batch_size={micro} must divide the per-rank mini-batch "
                    f"{role}.ppo_mini_batch_size / {group_dp} ranks = {mini // group_dp}"
                )
        rdp = lay.rollout.dp or lay.dp
        name = self.rollout.name
        if lay.rollout.tp != 1:
            raise ValueError(
                f"actor.layout.rollout.tp={lay.rollout.tp}: the {name} rollout keeps full "
                "weights per replica; tensor-parallel rollout is not built"
            )
        if rdp != lay.dp and not self.separate_rollout:
            raise ValueError(
                f"actor.layout.rollout.dp={rdp}: with a colocated rollout every training "
                f"rank is one replica, so it must equal actor.layout.dp={lay.dp}"
            )
        return self

    @model_validator(mode="after")
    def _check_rollout_engine(self) -> HybridConfig:
        """A backend with an engine of its own (registered `in_place=False`: vllm) refuses what
        it does not run."""
        name = self.rollout.name
        if ROLLOUT_BACKENDS.info(name)["in_place"]:
            return self
        r, why = self.rollout, f"with rollout.name={name}"
        refused = [
            (
                r.top_p < 1 or r.top_k > 0,
                f"rollout.top_p={r.top_p} / top_k={r.top_k} {why}: "
                "its log-probs would be of the truncated distribution, the trainer's of the full "
                "one; set rollout.top_p=1 and rollout.top_k=0",
            ),
            (
                self.actor.layout.rollout.separate_copy,
                "actor.layout.rollout.separate_copy applies to the hf rollout only",
            ),
            (
                self.model.dtype != "float32" and self.device == "cpu",
                f"model.dtype={self.model.dtype} {why} on CPU: only float32 is verified",
            ),
        ]
        for bad, message in refused:
            if bad:
                raise ValueError(f"{message}; or use rollout.name=hf")
        return self

    @model_validator(mode="after")
    def _check_sharing(self) -> HybridConfig:
        """ray.when_busy=share refuses, in one line, what a shared pool does not run yet."""
        if self.ray.when_busy != "share" or self.trainer.backend != "ray":
            return self
        why = "with ray.when_busy=share is not built yet"
        if self.ray.rollout == "separate":
            k = self.trainer.max_staleness
            cause = f" (trainer.max_staleness={k} asks for it)" if k else ""
            raise ValueError(f"ray.rollout=separate{cause} {why}; use ray.when_busy=refuse")
        return self


def _kv(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


_YAML_DATA: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("yaml")


class _YamlSource(PydanticBaseSettingsSource):
    """The YAML preset, below the environment in precedence."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return _YAML_DATA.get({}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_YAML_DATA.get({}))
