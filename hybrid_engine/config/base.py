"""The building blocks of the config tree: the error type, the strict section base class and
the option types shared by several sections."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import PydanticCustomError, core_schema

from hybrid_engine.registry import (
    ADV_ESTIMATORS,
    IS_LEVELS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_BACKENDS,
    Registry,
)


class RegisteredName:
    """`Annotated[str, RegisteredName(REGISTRY)]`: the value must be a name of the registry
    (checked when the config is built; its JSON schema and the reference list the names)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        return {**handler(schema), "enum": list(self.registry)}

    def _check(self, name: str) -> str:
        if name not in self.registry:
            raise PydanticCustomError(
                UNREGISTERED,
                "is not a registered {kind}; registered: {names} (register your own with a "
                "decorator in a module listed in algorithm.plugins)",
                {"kind": self.registry.kind, "names": ", ".join(self.registry)},
            )
        return name


UNREGISTERED = "unregistered_name"  # the error type `load_config` words as "key='x' is not..."
AdvEstimatorName = Annotated[str, RegisteredName(ADV_ESTIMATORS)]
PolicyLossName = Annotated[str, RegisteredName(POLICY_LOSSES)]
LossAggMode = Annotated[str, RegisteredName(LOSS_AGG_MODES)]
KLKind = Annotated[str, RegisteredName(KL_ESTIMATORS)]
ISLevel = Annotated[str, RegisteredName(IS_LEVELS)]
RolloutBackend = Annotated[str, RegisteredName(ROLLOUT_BACKENDS)]


# Who reads a key: "run" (every stage of every step: the data, the model, the seed), a
# stage ("rollout", "reward", "advantage"), "update", or "where" (where the run lives and
# runs, not what it computes: a resume may change it). Declared on a field, it covers the
# field's whole section unless a field inside declares its own (`reads_of` collects them);
# forks and resumes check changed keys against it (`flows.opening`).
READERS = ("run", "rollout", "reward", "advantage", "update", "where")


def reads(*who: str) -> dict[str, Any]:
    """`Field(..., json_schema_extra=reads("advantage", "update"))`."""
    unknown = set(who) - set(READERS)
    if unknown:
        raise ValueError(f"unknown readers {sorted(unknown)}; known: {', '.join(READERS)}")
    return {"read_by": list(who)}


class ConfigError(ValueError):
    """A bad configuration; the message names the key and the value."""


class Section(BaseModel):
    # every float must be finite: lr=.inf would train and write non-finite weights
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    warmup_steps: int = Field(0, ge=0, description="linear LR warm-up, in optimizer steps")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="the LR after warm-up: constant, or decaying (linear or cosine) to "
        "min_lr_ratio x lr at the run's last optimizer step",
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="the decay's end, a share of lr")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
