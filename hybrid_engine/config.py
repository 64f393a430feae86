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
from urllib.parse import urlsplit

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


class RolloutLayout(Section):
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per rollout replica (vllm only)")
    dp: int | None = Field(
        None, ge=1, description="rollout replicas; None = one per training rank (colocated)"
    )
    separate_copy: bool = Field(
        False,
        description="keep a persistent full rollout copy of the weights instead of sharing "
        "(1 rank) or gathering-then-releasing them (FSDP); the baseline of bench/memory.py",
    )


class ActorLayout(Section):
    """Per-stage layout of the actor group (3D-HybridEngine): train sharded, generate whole."""

    update: Literal["fsdp"] = Field(
        "fsdp", description="training layout: FSDP2 over `dp` ranks (1 rank = plain model)"
    )
    dp: int = Field(1, ge=1, description="data-parallel ranks of the actor group")
    rollout: RolloutLayout = Field(default_factory=RolloutLayout)


class ActorConfig(Section):
    optim: OptimConfig = Field(default_factory=OptimConfig)
    layout: ActorLayout = Field(default_factory=ActorLayout)
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
    model_path: str | None = Field(
        None,
        description="a sequence-classification reward model (local HF dir, or `tiny` for a "
        "random one in tests); its score replaces the rule/function score; None = off",
    )
    model_micro_batch_size: int = Field(16, gt=0)


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
    save_freq: int = Field(
        0,
        ge=0,
        description="weights checkpoint every N steps (and always at the end); 0 = end only",
    )
    max_ckpt_to_keep: int = Field(
        2, ge=0, description="checkpoints kept; older ones are deleted; 0 = all"
    )
    backend: Literal["local", "ray"] = Field(
        "local", description="local = roles in this process; ray = the persistent worker pool"
    )
    run_id: str | None = Field(None, description="None = <preset>-<timestamp>")
    num_threads: int = Field(0, ge=0, description="torch threads; 0 = all cores")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "output_dir" in data:
            raise ValueError("trainer.output_dir was replaced by storage.root")
        return data


class StorageConfig(Section):
    """Where a run's stage state, checkpoints and final policy live (any fsspec URL).

    S3 credentials come from the environment or the standard AWS chain
    (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE ...), never from this config."""

    root: str = Field("runs", description="a local directory or s3://bucket/prefix")
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint, e.g. http://127.0.0.1:9000 (None = AWS)"
    )
    timeout_s: float = Field(60, gt=0, description="connect/read timeout of one S3 request")
    retries: int = Field(
        4, ge=0, description="botocore retries of one S3 request (standard mode, with backoff)"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_secrets(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if any(w in key.lower() for w in ("key", "secret", "token", "password")):
                    raise ValueError(
                        f"storage.{key}: credentials never go in the config; set "
                        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment"
                    )
            root = data.get("root")
            if isinstance(root, str) and "@" in urlsplit(root).netloc:
                raise ValueError("storage.root: credentials never go in the URL")
        return data


class TrackingConfig(Section):
    """MLflow: one MLflow run per training run (a resumed run continues the same one)."""

    enabled: bool = True
    uri: str | None = Field(
        None, description="tracking URI; None = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db "
        "in the working directory",
    )  # fmt: skip
    experiment: str = Field("hybridrl", min_length=1, description="MLflow experiment name")
    val_samples: int = Field(
        8, ge=0, description="validation generations logged as a table (prompt, response, score)"
    )


class PipelineConfig(Section):
    """The Prefect stage pipeline: retries of a stage task on a transient failure."""

    retries: int = Field(2, ge=0, description="retries of a stage task on a transient error")
    retry_delay_s: float = Field(
        2.0, ge=0, description="first retry delay; doubles on each further retry"
    )


class RayConfig(Section):
    """The persistent worker pool: where it runs and how its roles are placed."""

    pool_name: str = Field(
        "default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
        description="names the pool's Ray namespace; drivers with the same name share workers",
    )  # fmt: skip
    address: str | None = Field(
        None, description="Ray cluster address; None = $RAY_ADDRESS, else a local head"
    )
    head_num_cpus: int = Field(
        16, gt=0, description="logical CPUs of a locally started head (a scheduling label)"
    )
    num_cpus_per_rank: float = Field(1.0, gt=0)
    num_gpus_per_rank: float = Field(0.0, ge=0)
    critic: Literal["colocated", "separate"] = Field(
        "colocated", description="critic in the actor ranks' processes, or its own group"
    )
    critic_dp: int = Field(1, ge=1, description="ranks of a separate critic group")
    reward_model: Literal["colocated", "separate"] = "colocated"
    reward_model_dp: int = Field(1, ge=1, description="ranks of a separate reward-model group")
    call_timeout_s: float = Field(
        3600, gt=0, description="longest wait for one stage call (also the collective timeout)"
    )
    start_timeout_s: float = Field(180, gt=0, description="longest wait for workers to start")
    worker_env: dict[str, str] = Field(
        default_factory=lambda: {"MALLOC_MMAP_THRESHOLD_": "4194304"},
        description="environment of the worker processes. The default fixes glibc's mmap "
        "threshold at 4 MiB: freed weight/gradient buffers go back to the OS instead of "
        "fragmenting the heap (SmolLM2, 2 FSDP ranks: peak RSS per rank 4.2 -> 2.8 GB, same "
        "step time; 128 KiB gives 2.1 GB but updates 40% slower)",
    )


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
    ray: RayConfig = Field(default_factory=RayConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

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

    @property
    def device(self) -> str:
        """Where the workers' models live: GPUs when the pool reserves them, else the CPU."""
        gpu = self.trainer.backend == "ray" and self.ray.num_gpus_per_rank > 0
        return "cuda" if gpu else "cpu"

    @property
    def use_reward_model(self) -> bool:
        return self.reward.model_path is not None

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
            if self.ray.critic == "separate" or self.ray.reward_model == "separate":
                raise ValueError(
                    "ray.critic / ray.reward_model = separate need trainer.backend=ray"
                )
        n = self.samples_per_step
        for key, group_dp, size in [
            ("actor.ppo_mini_batch_size", lay.dp, self.actor.ppo_mini_batch_size),
            ("critic.ppo_mini_batch_size", ranks.get("ray.critic_dp", lay.dp),
             self.critic.ppo_mini_batch_size),
        ]:  # fmt: skip
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
            per_rank.append(("critic", ranks.get("ray.critic_dp", lay.dp), c.ppo_mini_batch_size,
                             c.ppo_micro_batch_size))  # fmt: skip
        for role, group_dp, mini, micro in per_rank:
            if (mini // group_dp) % micro:
                raise ValueError(
                    f"{role}.ppo_micro_batch_size={micro} must divide the per-rank mini-batch "
                    f"{role}.ppo_mini_batch_size / {group_dp} ranks = {mini // group_dp}"
                )
        rdp = lay.rollout.dp or lay.dp
        if self.rollout.name == "hf":
            if lay.rollout.tp != 1:
                raise ValueError(
                    f"actor.layout.rollout.tp={lay.rollout.tp}: the hf rollout keeps full weights "
                    "per replica; tensor-parallel rollout needs rollout.name=vllm (GPU)"
                )
            if rdp != lay.dp:
                raise ValueError(
                    f"actor.layout.rollout.dp={rdp}: with the colocated hf rollout every training "
                    f"rank is one replica, so it must equal actor.layout.dp={lay.dp}"
                )
        else:
            if backend != "ray" or self.ray.num_gpus_per_rank <= 0:
                raise ValueError(
                    "rollout.name=vllm runs on GPUs in the Ray pool: set trainer.backend=ray and "
                    "ray.num_gpus_per_rank > 0 (install the [vllm] extra on a GPU machine)"
                )
            if lay.rollout.tp * rdp != lay.dp:
                raise ValueError(
                    f"actor.layout.rollout.tp={lay.rollout.tp} x dp={rdp} must equal "
                    f"actor.layout.dp={lay.dp}: the rollout engines use the training ranks' GPUs"
                )
            if lay.rollout.separate_copy:
                raise ValueError(
                    "actor.layout.rollout.separate_copy applies to the hf rollout only"
                )
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
        elif key and e["type"] != "value_error":  # our own validators name the key
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
    return config_from_dict(data, overrides)


def config_from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> HybridConfig:
    """Like `load_config`, from a dict in place of the YAML file (a stored run's config)."""
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
