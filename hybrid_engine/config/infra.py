"""The sections that say where and how a run executes: trainer loop, storage, MLflow
tracking, the Prefect pipeline and the Ray pool."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from hybrid_engine.config.base import Section, reads


class TrainerConfig(Section):
    total_training_steps: int = Field(
        2,
        gt=0,
        description="steps of the run (rollout → reward → advantage → update each)",
        json_schema_extra=reads("where"),
    )
    seed: int = Field(
        1,
        description="seed of weights and sampling: same seed on CPU = same weights",
        json_schema_extra=reads("run"),
    )
    test_freq: int = Field(
        0,
        ge=0,
        description="validate every N steps; 0 = only at the end",
        json_schema_extra=reads("where"),
    )
    val_before_train: bool = Field(True, description="validate the initial policy (step 0)")
    save_freq: int = Field(
        0,
        ge=0,
        description="weights checkpoint every N steps (and always at the end); 0 = end only",
        json_schema_extra=reads("where"),
    )
    max_ckpt_to_keep: int = Field(
        2,
        ge=0,
        description="checkpoints kept; older ones are deleted; 0 = all",
        json_schema_extra=reads("where"),
    )
    backend: Literal["local", "ray"] = Field(
        "local",
        description="local = roles in this process; ray = the persistent worker pool",
        json_schema_extra=reads("where"),
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="asynchronous (off-policy) training: the rollout of step N+k uses "
        "weights version N-1, so it runs while steps N..N+k-1 train; 0 = synchronous. > 0 "
        "puts generation in its own pool group (trainer.backend=ray, ray.rollout=separate) and "
        "corrects the staleness with algorithm.rollout_correction (level token if unset)",
        json_schema_extra=reads("rollout"),
    )
    run_id: str | None = Field(None, description="None = <preset>-<timestamp>")
    num_threads: int = Field(
        0, ge=0, description="torch threads; 0 = all cores", json_schema_extra=reads("where")
    )
    deterministic: bool = Field(
        True,
        description="torch.use_deterministic_algorithms (warn only where an op has no "
        "deterministic kernel). Without it, on 2 CPU threads, the SmolLM2 demo's update 16 "
        "came out in one of two roundings from process to process (updates 11-15 did not); "
        "with it, 3 of 3 processes agreed, equal to 1 thread, at no measurable cost",
        json_schema_extra=reads("where"),
    )
    reuse_freed_memory: bool = Field(
        True,
        description="keep freed memory in the process (glibc: no mmap, no trim, one arena) "
        "instead of returning it to the OS and faulting it back in at every update (SmolLM2 "
        "demo: update 9-10 -> 7 s; over 100 steps RSS in a 4.2-4.6 GB band, not growing, against "
        "3.6-4.1 GB without): in the driving process (where the "
        "models live with the local backend) and, on the pool, in the workers of single-rank "
        "groups, by their environment (MALLOC_* variables, under ray.worker_env's); FSDP ranks "
        "follow ray.worker_env alone",
        json_schema_extra=reads("where"),
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
    lease_timeout_s: float | None = Field(
        None,
        ge=5,
        description="one driver per run: another driver takes the run over when the "
        "holder's heartbeat is this old (at once when the holder's process, on this host, "
        "is gone). Unset: 3 x request_bound_s (one S3 request's worst case with its "
        "retries), at least 60; a smaller value is refused",
    )
    single_driver: bool = Field(
        False,
        description="the store cannot create an object only if none exists (S3 "
        "`If-None-Match: *`, a hard link on a local disk) and only one driver ever trains "
        "a run at a time: the lease is taken with a plain write, which does not keep two "
        "drivers racing for a run from both taking it",
    )
    shared_filesystem: bool = Field(
        False,
        description="a local root is on a filesystem every Ray node mounts (NFS, "
        "Lustre, ...): a pool across several nodes may use it",
    )

    @property
    def request_bound_s(self) -> float:
        """The longest one storage request may take with its retries: on S3 (retries + 1)
        attempts of connect + read timeout, plus botocore's backoff (standard mode: at most
        2^i s, capped at 20, before retry i); 0 on a local disk (no timeout to bound it)."""
        if not self.root.startswith("s3://"):
            return 0.0
        backoff = sum(min(2.0**i, 20.0) for i in range(self.retries))
        return (self.retries + 1) * 2 * self.timeout_s + backoff

    @model_validator(mode="after")
    def _lease_outlasts_retries(self) -> StorageConfig:
        """A healthy holder's heartbeats may each take request_bound_s, and it must stop
        writing one request_bound_s before a takeover: the timeout holds three."""
        least = 3 * self.request_bound_s
        if self.lease_timeout_s is None:
            self.__dict__["lease_timeout_s"] = max(60.0, least)  # no re-validation
        elif self.lease_timeout_s < least:
            raise ValueError(
                f"storage.lease_timeout_s={self.lease_timeout_s:g} is shorter than 3 x one "
                f"request's worst case ({self.request_bound_s:g} s from storage.timeout_s="
                f"{self.timeout_s:g} and storage.retries={self.retries}): a healthy driver "
                f"could lose its run to its own retries; use at least {least:g}, leave it "
                "unset (derived), or lower storage.timeout_s / storage.retries"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _stored_before_derived(cls, data: Any) -> Any:
        """A run.json recorded before the lease timeout was derived holds every key of this
        section but single_driver, and the old default lease_timeout_s=60: read as unset."""
        old = {"root", "endpoint_url", "timeout_s", "retries", "lease_timeout_s"}
        stored = isinstance(data, dict) and set(data) == old | {"shared_filesystem"}
        if stored and data["lease_timeout_s"] == 60:
            data = {**data, "lease_timeout_s": None}
        return data

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
            for key in ("root", "endpoint_url"):
                no_credentials_in_url(f"storage.{key}", data.get(key))
        return data


def no_credentials_in_url(key: str, url: Any) -> None:
    """Refuse `scheme://user:password@host` (the message never repeats the URL: it would
    put the secret into logs)."""
    if isinstance(url, str) and "@" in urlsplit(url).netloc:
        raise ValueError(
            f"{key}: credentials never go in the URL (they would be recorded with the run); "
            "give them through the environment"
        )


class TrackingConfig(Section):
    """MLflow: one MLflow run per training run (a resumed run continues the same one)."""

    enabled: bool = Field(True, description="log the run to MLflow")
    uri: str | None = Field(
        None,
        description="tracking URI; None = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db "
        "in the working directory",
    )
    experiment: str = Field("hybridrl", min_length=1, description="MLflow experiment name")

    val_samples: int = Field(
        8, ge=0, description="validation generations logged as a table (prompt, response, score)"
    )


class RegistryConfig(Section):
    """The MLflow Model Registry: the final policy as a model version, its evaluation
    (`hybridrl evaluate`, the `evaluate` flow) and the promotion gate for the alias
    `champion`."""

    register_final: bool = Field(
        True,
        description="register final/ as a version of model_name when the run ends "
        "(needs tracking.enabled)",
    )
    model_name: str = Field("hybridrl-policy", min_length=1, description="registered model name")
    eval_k: int = Field(4, ge=1, description="samples per held-out question for pass@k, maj@k")
    promotion_margin: float = Field(
        0.01, description="accuracy a version must add to the champion's to take the alias"
    )
    min_format_rate: float = Field(
        0.5,
        ge=0,
        le=1,
        description="share of greedy responses with an extractable final "
        "answer a version needs to be promoted",
    )
    min_length_ratio: float = Field(
        0.5,
        ge=0,
        description="mean response length at least this times the champion's (else collapsed)",
    )
    max_length_ratio: float = Field(
        2.0,
        gt=0,
        description="mean response length at most this times the champion's (else exploded)",
    )
    max_clip_ratio: float = Field(
        0.5,
        ge=0,
        le=1,
        description="share of greedy responses cut at the token limit a version may have",
    )


class PipelineConfig(Section):
    """The Prefect stage pipeline: retries of a stage task on a transient failure, and the
    recovery from dead or hung pool workers."""

    retries: int = Field(2, ge=0, description="retries of a stage task on a transient error")
    retry_delay_s: float = Field(
        2.0, ge=0, description="first retry delay; doubles on each further retry"
    )
    max_recoveries: int = Field(
        3,
        ge=0,
        description="dead or hung workers recovered from per flow run (pool "
        "re-created, last checkpoint restored); one more fails the run",
    )
    recovery_delay_s: float = Field(
        5.0, ge=0, description="wait before re-creating the pool; doubles on each recovery"
    )
    max_driver_restarts: int = Field(
        3,
        ge=0,
        description="restarts in a row, by a deployment's trigger on a Crashed flow run, "
        "that find no newly committed update; one more refuses (a crash loop)",
    )
    stage_timeout_s: float = Field(
        300,
        gt=0,
        description="floor of a stage's time limit on the pool; a worker that "
        "does not answer within the limit is declared hung",
    )
    stage_timeout_factor: float = Field(
        5.0,
        ge=1,
        description="a stage's limit: this times the slowest of its last 5 wall "
        "times (at least stage_timeout_s); before its first run: ray.call_timeout_s",
    )


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")  # not custom ones


class RayConfig(Section):
    """The persistent worker pool: where it runs and how its roles are placed."""

    pool_name: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
        description="names the pool's Ray namespace; drivers with the same name share workers",
    )
    when_busy: Literal["refuse", "wait", "share"] = Field(
        "refuse",
        description="a pool another run trains on: refuse in one line, wait until it is free, "
        "or share it: the runs take turns stage by stage, each with its own weights, "
        "optimizer and RNG state in the workers (guides/sharing-a-pool.md)",
    )
    max_runs: int = Field(
        4, ge=1, description="ray.when_busy=share: most runs attached to the pool at once"
    )
    priority: int = Field(
        0,
        description="ray.when_busy=share: of the runs waiting for a turn, a higher priority "
        "goes first; equal ones take turns round robin at stage boundaries",
    )
    max_resident_gb: float = Field(
        16.0,
        gt=0,
        description="ray.when_busy=share: most GB of model and optimizer state a worker keeps "
        "in memory for all attached runs together (the same for every run of the pool); past "
        "it the runs parked longest are offloaded to the worker's disk until their turn; a run "
        "whose own state passes it is refused at attach",
    )
    turn_slice_s: float = Field(
        600.0,
        gt=0,
        description="ray.when_busy=share: a turn held longer than this while other runs wait "
        "is reported (warned, and marked in `hybridrl pool status`)",
    )
    claim_timeout_s: float = Field(
        60,
        ge=5,
        description="a run's claim on the pool lapses when not renewed this long (at once "
        "when its driver, on this host, is gone)",
    )
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
    rollout: Literal["colocated", "separate"] = Field(
        "colocated",
        description="generation in the actor ranks' processes (hybrid engine), "
        "or in its own group fed the trainer's weights after each update (asynchronous "
        "training needs it)",
    )
    rollout_dp: int = Field(1, ge=1, description="replicas of a separate rollout group")
    placement: Literal["pack", "spread", "strict_spread"] = Field(
        "pack",
        description="how each group's ranks are placed on the cluster's nodes (a Ray "
        "placement group per group): pack = as few nodes as fit, spread = across nodes where "
        "possible, strict_spread = every rank on its own node",
    )
    actor_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each actor rank needs, e.g. "
        '{"trainer": 1} pins the actor group to nodes started with that resource',
    )
    critic_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each rank of a separate critic group needs",
    )
    rollout_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each replica of a separate rollout group needs",
    )
    reward_model_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each rank of a separate reward-model group needs",
    )
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

    @model_validator(mode="after")
    def _custom_resources(self) -> RayConfig:
        for key in [k for k in type(self).model_fields if k.endswith("_resources")]:
            for name, amount in getattr(self, key).items():
                if name in RAY_BUILTIN_RESOURCES or not name:
                    raise ValueError(
                        f"ray.{key}: {name!r} is not a custom resource (CPUs and "
                        "GPUs per rank: ray.num_cpus_per_rank / "
                        "ray.num_gpus_per_rank)"
                    )
                if amount <= 0:
                    raise ValueError(f"ray.{key}.{name}: {amount} must be > 0")
        return self
