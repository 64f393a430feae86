"""The configuration tree: one pydantic-settings model, verl-style key names.

Precedence, highest first:
    dotted command-line overrides   actor.optim.lr=1e-6
    environment variables           HYBRIDRL_ACTOR__OPTIM__LR=1e-6
    the YAML preset                 configs/demo_cpu.yaml
    the defaults

Batch sizes are counted in *samples* (responses) except `data.train_batch_size`, which
counts prompts: one step generates `data.train_batch_size * rollout.n` samples.
Any problem (unknown key, wrong type, inconsistent sizes) raises one `ConfigError` that
names the key and the value.

Modules: `base` (error, section base, shared types), `training` (what is trained and how),
`infra` (where it runs), `root` (`HybridConfig` and its cross-section checks), `loading`
(`load_config`, overrides, `flatten`, the reference the docs site renders).
"""

from hybrid_engine.config.base import ConfigError, KLKind, LossAggMode, OptimConfig, Section
from hybrid_engine.config.infra import (
    PipelineConfig,
    RayConfig,
    RegistryConfig,
    StorageConfig,
    TrackingConfig,
    TrainerConfig,
)
from hybrid_engine.config.loading import (
    REDACTED,
    config_from_dict,
    config_reference,
    flatten,
    load_config,
    parse_overrides,
    reads_of,
    redact,
    redacted_keys,
    registries_reference,
)
from hybrid_engine.config.root import HybridConfig
from hybrid_engine.config.training import (
    ActorConfig,
    ActorLayout,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    KLControlConfig,
    ModelConfig,
    MultiTurnConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    RolloutLayout,
    TinyModelConfig,
    ValSamplingConfig,
    import_plugins,
)

__all__ = [
    "ActorConfig",
    "ActorLayout",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "HybridConfig",
    "KLControlConfig",
    "KLKind",
    "LossAggMode",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "PipelineConfig",
    "RayConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "RegistryConfig",
    "RolloutLayout",
    "Section",
    "StorageConfig",
    "TinyModelConfig",
    "TrackingConfig",
    "TrainerConfig",
    "ValSamplingConfig",
    "REDACTED",
    "config_from_dict",
    "config_reference",
    "flatten",
    "import_plugins",
    "load_config",
    "parse_overrides",
    "reads_of",
    "redact",
    "redacted_keys",
    "registries_reference",
]
