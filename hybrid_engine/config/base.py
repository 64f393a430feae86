"""The building blocks of the config tree: the error type, the strict section base class and
the option types shared by several sections."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]  # fmt: skip
KLKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


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
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
