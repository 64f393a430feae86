"""The configuration tree: one pydantic-settings model, verl-style key names.

Precedence, highest first:
    dotted command-line overrides   actor.optim.lr=1e-6
    environment variables           HYBRIDRL_ACTOR__OPTIM__LR=1e-6
    the YAML preset                 configs/demo_cpu.yaml
    the defaults below

Batch sizes are counted in *samples* (responses) except `data.train_batch_size`, which
counts prompts: one step generates `data.train_batch_size * rollout.n` samples.
Any problem (unknown key, wrong type, inconsistent sizes) raises one `ConfigError` that
names the key and the value.
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
KLKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


class ConfigError(ValueError):
    """A bad configuration; the message names the key and the value."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0, description="linear LR warm-up, in optimizer steps")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")


class TinyModelConfig(Section):
    """Shape of the tiny random Llama used by tests (`model.path: tiny`)."""

    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    max_position_embeddings: int = Field(1024, gt=0)


class DataConfig(Section):
    train_source: str = Field(
        "reasoning_gym:basic_arithmetic",
        description="`reasoning_gym:<task>` or a .parquet/.jsonl file of verl-style rows",
    )
    val_source: str | None = Field(
        None, description="validation rows; None = a held-out split of the task generator"
    )
    task_config: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the reasoning-gym generator"
    )
    train_size: int = Field(2000, gt=0)
    val_size: int = Field(64, ge=0)
    train_seed: int = 1000
    val_seed: int = Field(
        900_000, description="generator seed of the validation split (keep it far from train)"
    )
    system_prompt: str | None = None
    prompt_suffix: str = ""
    train_batch_size: int = Field(8, gt=0, description="prompts per step")
    max_prompt_length: int = Field(256, gt=0)


class ModelConfig(Section):
    path: str = Field(
        "tiny",
        description="a local HF directory, `smollm2-135m-instruct` (packaged), or `tiny`",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class ActorConfig(Section):
    optim: OptimConfig = Field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = Field(32, gt=0, description="samples per optimizer step")
    ppo_micro_batch_size: int = Field(8, gt=0, description="samples per forward/backward")
    ppo_epochs: int = Field(1, gt=0)
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    clip_ratio_c: float = Field(3.0, gt=1)
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: KLKind = "low_var_kl"
    log_prob_micro_batch_size: int = Field(16, gt=0)


class ValSamplingConfig(Section):
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    max_new_tokens: int | None = Field(None, description="None = rollout.max_new_tokens")


class RolloutConfig(Section):
    name: Literal["hf", "vllm"] = "hf"
    n: int = Field(4, gt=0, description="samples per prompt")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    max_new_tokens: int = Field(32, gt=0)
    micro_batch_size: int = Field(64, gt=0, description="sequences per generate call")
    val: ValSamplingConfig = Field(default_factory=ValSamplingConfig)


class RefConfig(Section):
    log_prob_micro_batch_size: int = Field(16, gt=0)


class CriticConfig(Section):
    model_path: str | None = Field(None, description="None = initialise from the policy")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = Field(32, gt=0)
    ppo_micro_batch_size: int = Field(8, gt=0)
    ppo_epochs: int = Field(1, gt=0)
    cliprange_value: float = Field(0.5, gt=0)
    loss_agg_mode: LossAggMode = "token-mean"


class RewardConfig(Section):
    function: str | None = Field(
        None,
        description="`module:function` scoring (prompts, completions, rows) -> floats; "
        "None = the task's own scorer (reasoning-gym) or the numeric rule scorer (rows)",
    )
    answer_format: Literal["last_number", "hashes"] = Field(
        "last_number", description="how the rule scorer extracts the final answer"
    )
    overlong_buffer_len: int = Field(
        0,
        ge=0,
        description="DAPO soft overlong punishment: responses longer than "
        "rollout.max_new_tokens - this lose up to overlong_penalty_factor; 0 = off",
    )
    overlong_penalty_factor: float = Field(1.0, ge=0)


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    target_kl: float = Field(0.1, gt=0)
    horizon: int = Field(10000, gt=0)


class AlgorithmConfig(Section):
    adv_estimator: Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "remax"] = "grpo"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLKind = "kl"
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)


class TrainerConfig(Section):
    total_training_steps: int = Field(2, gt=0)
    seed: int = 1
    test_freq: int = Field(0, ge=0, description="validate every N steps; 0 = only at the end")
    val_before_train: bool = True
    output_dir: str = "runs"
    run_id: str | None = Field(None, description="None = <preset>-<timestamp>")
    num_threads: int = Field(0, ge=0, description="torch threads; 0 = all cores")


class HybridConfig(BaseSettings):
    """The whole run. Sections mirror the pipeline's parts."""

    model_config = SettingsConfigDict(
        env_prefix="HYBRIDRL_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        nested_model_default_partial_update=True,
    )

    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)

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
    def use_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def samples_per_step(self) -> int:
        return self.data.train_batch_size * self.rollout.n

    @model_validator(mode="after")
    def _check_batch_sizes(self) -> HybridConfig:
        n = self.samples_per_step
        checks = [
            ("actor.ppo_mini_batch_size", self.actor.ppo_mini_batch_size, n,
             "data.train_batch_size * rollout.n"),
            ("actor.ppo_micro_batch_size", self.actor.ppo_micro_batch_size,
             self.actor.ppo_mini_batch_size, "actor.ppo_mini_batch_size"),
        ]  # fmt: skip
        if self.use_critic:
            checks += [
                ("critic.ppo_mini_batch_size", self.critic.ppo_mini_batch_size, n,
                 "data.train_batch_size * rollout.n"),
                ("critic.ppo_micro_batch_size", self.critic.ppo_micro_batch_size,
                 self.critic.ppo_mini_batch_size, "critic.ppo_mini_batch_size"),
            ]  # fmt: skip
        for key, size, total, total_name in checks:
            if size > total or total % size:
                raise ValueError(
                    f"{key}={size} must divide {total_name}={total} "
                    f"(data.train_batch_size={self.data.train_batch_size}, rollout.n={self.rollout.n})"
                )
        if self.rollout.name == "vllm":
            raise ValueError(
                "rollout.name='vllm': the vLLM backend is not built yet (GPU extra, planned "
                "with the Ray pool); use rollout.name=hf"
            )
        if self.reward.overlong_buffer_len >= self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer_len={self.reward.overlong_buffer_len} must be smaller "
                f"than rollout.max_new_tokens={self.rollout.max_new_tokens}"
            )
        if self.algorithm.adv_estimator in ("grpo", "rloo") and self.rollout.n < 2:
            raise ValueError(
                f"rollout.n={self.rollout.n}: {self.algorithm.adv_estimator} compares samples "
                "of one prompt, it needs rollout.n >= 2"
            )
        return self


_YAML_DATA: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("yaml")


class _YamlSource(PydanticBaseSettingsSource):
    """The YAML preset, below the environment in precedence."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return _YAML_DATA.get({}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_YAML_DATA.get({}))


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["actor.optim.lr=1e-6", "rollout.n=8"]` -> nested dict; values parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        value = yaml.safe_load(raw) if raw.strip() else ""
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override")
        node[parts[-1]] = value
    return out


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r} (value {e['input']!r})")
        elif key:
            lines.append(f"{key}={e['input']!r}: {e['msg']}")
        else:
            lines.append(e["msg"].removeprefix("Value error, "))
    return "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> HybridConfig:
    """Build the config from a YAML preset, the environment, and dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    token = _YAML_DATA.set(data)
    try:
        return HybridConfig(**parse_overrides(overrides or []))
    except ValidationError as e:
        raise ConfigError(f"invalid config: {_describe(e)}") from None
    finally:
        _YAML_DATA.reset(token)


def flatten(cfg: BaseModel, prefix: str = "") -> dict[str, Any]:
    """`{"actor.optim.lr": 1e-05, ...}` for logging and comparing runs."""
    out: dict[str, Any] = {}
    for name, value in cfg:
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            out |= flatten(value, key + ".")
        else:
            out[key] = value
    return out
