"""`rollout.vllm`: the settings of the vLLM rollout engine (`rollout.name: vllm`)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from hybrid_engine.config.base import Section


class VLLMSettings(Section):
    """The engine runs in its own environment and process (`scripts/setup_vllm.sh`); these
    are checked before it starts, each error naming its key."""

    kv_cache_gb: int = Field(
        1, ge=0, description="GiB of KV cache the engine reserves (VLLM_CPU_KVCACHE_SPACE)"
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="longest prompt + response the engine takes; None = data.max_prompt_length "
        "+ the widest response",
    )
    threads_bind: str = Field(
        "",
        description="cores the engine's OpenMP threads are bound to, a list such as 0-1 "
        "(VLLM_CPU_OMP_THREADS_BIND); empty = every core of the machine",
    )
    compile: bool = Field(
        False,
        description="compile the model with torch.compile (vLLM's enforce_eager=False); "
        "measured no faster than eager on 2 CPU cores and 7x slower to start; false = eager",
    )
    start_timeout_s: float = Field(
        600, gt=0, description="longest wait for the engine to load (it is refused after it)"
    )

    @field_validator("threads_bind", mode="before")
    @classmethod
    def _core_list(cls, v: object) -> object:
        if isinstance(v, int) and not isinstance(v, bool):  # one core, read as a number
            v = str(v)
        if not isinstance(v, str):
            return v  # the field's own type check answers
        ranges = [m.groups() for m in re.finditer(r"(\d+)(?:-(\d+))?(,|$)", v)]
        parsed = ",".join(f"{lo}-{hi}" if hi else lo for lo, hi, _ in ranges)
        if parsed != v or any(hi and int(hi) < int(lo) for lo, hi, _ in ranges):
            raise ValueError(
                f"rollout.vllm.threads_bind={v!r}: expected core ids and ascending ranges "
                "such as 0-1 or 0,2-3"
            )
        return v
