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
import json
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin
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
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    warmup_steps: int = Field(0, ge=0, description="linear LR warm-up, in optimizer steps")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")


class TinyModelConfig(Section):
    """Shape of the tiny random Llama used by tests (`model.path: tiny`)."""

    hidden_size: int = Field(64, gt=0, description="width of the tiny model")
    intermediate_size: int = Field(128, gt=0, description="MLP width of the tiny model")
    num_hidden_layers: int = Field(2, gt=0, description="layers of the tiny model")
    num_attention_heads: int = Field(4, gt=0, description="attention heads of the tiny model")
    num_key_value_heads: int = Field(2, gt=0, description="key/value heads of the tiny model (GQA)")
    max_position_embeddings: int = Field(
        1024, gt=0, description="longest sequence of the tiny model"
    )


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
    train_size: int = Field(2000, gt=0, description="prompts generated for training (one epoch)")
    val_size: int = Field(64, ge=0, description="held-out prompts for validation")
    train_seed: int = Field(1000, description="generator seed of the training prompts")
    val_seed: int = Field(
        900_000, description="generator seed of the validation split (keep it far from train)"
    )
    system_prompt: str | None = Field(
        None, description="system message put before every prompt (chat template)"
    )
    prompt_suffix: str = Field("", description="text appended to every prompt")
    train_batch_size: int = Field(8, gt=0, description="prompts per step")
    max_prompt_length: int = Field(
        256, gt=0, description="longest prompt in tokens; a longer one is an error naming its row"
    )


class ModelConfig(Section):
    path: str = Field(
        "tiny",
        description="a local HF directory, `smollm2-135m-instruct` (packaged), or `tiny`",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="parameter dtype (CPU: float32)"
    )


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
    ppo_epochs: int = Field(1, gt=0, description="passes over a step's samples")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip: ratio ≥ 1 - this")
    clip_ratio_high: float = Field(
        0.2, ge=0, description="PPO clip: ratio ≤ 1 + this (DAPO clip-higher: raise it)"
    )
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip bound for negative advantages")
    loss_agg_mode: LossAggMode = Field(
        "token-mean", description="how token losses average into one (token-mean = DAPO)"
    )
    entropy_coeff: float = Field(0.0, description="entropy bonus weight in the policy loss")
    use_kl_loss: bool = Field(
        False, description="KL to the reference policy as a loss term (GRPO style)"
    )
    kl_loss_coef: float = Field(0.001, ge=0, description="weight of that KL loss")
    kl_loss_type: KLKind = Field("low_var_kl", description="KL estimator of that loss")
    log_prob_micro_batch_size: int = Field(
        16, gt=0, description="samples per forward when computing old log-probs"
    )
    pack_prompts: bool = Field(
        True,
        description="log-probs without padding, each prompt computed once for its rollout.n "
        "samples (one packed row per prompt group, block attention mask)",
    )


class ValSamplingConfig(Section):
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    max_new_tokens: int | None = Field(None, description="None = rollout.max_new_tokens")


class RolloutConfig(Section):
    name: Literal["hf", "vllm"] = Field(
        "hf",
        description="rollout backend: a decoding loop on the transformers model (StaticCache), "
        "or vLLM (GPU, [vllm] extra)",
    )
    n: int = Field(4, gt=0, description="samples per prompt")
    temperature: float = Field(1.0, ge=0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; 1 = off")
    top_k: int = Field(0, ge=0, description="0 = off")
    max_new_tokens: int = Field(32, gt=0, description="longest response in tokens")
    micro_batch_size: int = Field(64, gt=0, description="sequences decoded together")
    val: ValSamplingConfig = Field(default_factory=ValSamplingConfig)


class RefConfig(Section):
    log_prob_micro_batch_size: int = Field(
        16, gt=0, description="samples per forward of the reference policy"
    )


class CriticConfig(Section):
    model_path: str | None = Field(None, description="None = initialise from the policy")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = Field(32, gt=0, description="samples per critic optimizer step")
    ppo_micro_batch_size: int = Field(8, gt=0, description="samples per critic forward/backward")
    ppo_epochs: int = Field(1, gt=0, description="critic passes over a step's samples")
    cliprange_value: float = Field(0.5, gt=0, description="value clip around the old values")
    loss_agg_mode: LossAggMode = Field(
        "token-mean", description="how token value losses average into one"
    )


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
    overlong_penalty_factor: float = Field(
        1.0, ge=0, description="largest overlong penalty (at rollout.max_new_tokens)"
    )
    model_path: str | None = Field(
        None,
        description="a sequence-classification reward model (local HF dir, or `tiny` for a "
        "random one in tests); its score replaces the rule/function score; None = off",
    )
    model_micro_batch_size: int = Field(16, gt=0, description="samples per reward-model forward")


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed coefficient, or adaptive towards target_kl"
    )
    kl_coef: float = Field(0.001, ge=0, description="(initial) KL-in-reward coefficient")
    target_kl: float = Field(
        0.1, gt=0, description="adaptive: the KL the coefficient steers towards"
    )
    horizon: int = Field(
        10000, gt=0, description="adaptive: samples over which the coefficient adapts"
    )


class AlgorithmConfig(Section):
    adv_estimator: Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "remax"] = Field(
        "grpo", description="registered advantage estimator (gae = PPO with a critic)"
    )
    gamma: float = Field(1.0, ge=0, le=1, description="discount (gae, reinforce_plus_plus)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda")
    norm_adv_by_std_in_grpo: bool = Field(
        True, description="divide GRPO advantages by the group's std (false: the Dr. GRPO variant)"
    )
    use_kl_in_reward: bool = Field(
        False, description="subtract a KL penalty to the reference from the token rewards"
    )
    kl_penalty: KLKind = Field("kl", description="KL estimator of that penalty")
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)


class TrainerConfig(Section):
    total_training_steps: int = Field(
        2, gt=0, description="steps of the run (rollout → reward → advantage → update each)"
    )
    seed: int = Field(
        1, description="seed of weights and sampling: same seed on CPU = same weights"
    )
    test_freq: int = Field(0, ge=0, description="validate every N steps; 0 = only at the end")
    val_before_train: bool = Field(True, description="validate the initial policy (step 0)")
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
    reuse_freed_memory: bool = Field(
        True,
        description="keep freed memory in the process (glibc: no mmap, no trim, one arena) "
        "instead of returning it to the OS and faulting it back in at every update (SmolLM2 "
        "demo: update 9-10 -> 7 s, peak RSS 3.7 -> 4.2 GB): in the driving process (where the "
        "models live with the local backend) and, on the pool, in the workers of single-rank "
        "groups, by their environment (MALLOC_* variables, under ray.worker_env's); FSDP ranks "
        "follow ray.worker_env alone",
    )

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

    enabled: bool = Field(True, description="log the run to MLflow")
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
    num_cpus_per_rank: float = Field(1.0, gt=0, description="Ray CPUs reserved per worker")
    num_gpus_per_rank: float = Field(
        0.0, ge=0, description="Ray GPUs per worker; > 0 puts the models on CUDA"
    )
    critic: Literal["colocated", "separate"] = Field(
        "colocated", description="critic in the actor ranks' processes, or its own group"
    )
    critic_dp: int = Field(1, ge=1, description="ranks of a separate critic group")
    reward_model: Literal["colocated", "separate"] = Field(
        "colocated", description="reward model in the actor ranks' processes, or its own group"
    )
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


# ----------------------------------------------------------------------------- reference
def _type_name(annotation: Any) -> str:
    """`int`, `float | None`, `"hf" \\| "vllm"` for the reference table."""
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if args and get_origin(annotation) in (UnionType, Union):
        return " \\| ".join(_type_name(a) for a in args)
    if annotation is type(None):
        return "None"
    if get_origin(annotation) in (dict, tuple):
        return str(annotation).replace("typing.", "")
    return getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: list[Any]) -> str:
    signs = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}
    out = [f"{s} {getattr(m, k)}" for m in metadata for k, s in signs.items() if hasattr(m, k)]
    return f" ({', '.join(out)})" if out else ""


def config_reference() -> str:
    """Every key of the config as markdown tables (key, default, type, meaning), one per
    section, from the model itself (README's configuration reference is this text)."""
    lines: list[str] = []

    def walk(model: BaseModel, prefix: str) -> None:
        leaves = []
        for name, field in type(model).model_fields.items():
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                continue
            default = "`None`" if value is None else f"`{json.dumps(value)}`"
            kind = _type_name(field.annotation) + _bounds(field.metadata)
            leaves.append(f"| `{prefix}{name}` | {default} | {kind} | {field.description or ''} |")
        if leaves:
            lines.extend(["", f"**{prefix.rstrip('.')}**", ""])
            doc = type(model).__doc__
            if doc and type(model) is not Section:
                lines.extend([" ".join(doc.split()), ""])
            lines.extend(["| key | default | type | meaning |", "| --- | --- | --- | --- |"])
            lines.extend(leaves)
        for name in type(model).model_fields:
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                walk(value, f"{prefix}{name}.")

    defaults = {name: f.get_default(call_default_factory=True)
                for name, f in HybridConfig.model_fields.items()}  # fmt: skip
    for name, section in defaults.items():
        walk(section, f"{name}.")
    return "\n".join(lines).strip() + "\n"
