"""The plain in-process loop around the Engine's stages, without Prefect or storage:

    engine, history = train(cfg)   # validate, N steps (validating every test_freq), validate

The stage pipeline (`flows.train`) runs the same four calls as checkpointed tasks.
"""

from __future__ import annotations

from collections.abc import Callable

from hybrid_engine.config import HybridConfig
from hybrid_engine.engine import Engine


def train(
    cfg: HybridConfig,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    engine: Engine | None = None,
) -> tuple[Engine, list[dict[str, float]]]:
    """Validate, N steps (validating every test_freq and after the last); returns the engine
    and each step's metrics, `on_step(step, metrics)` called as each ends (0: before)."""
    engine = engine or Engine(cfg)
    t = cfg.trainer
    history: list[dict[str, float]] = []
    if t.val_before_train:
        val = engine.validate()
        if on_step:
            on_step(0, val)
        history.append({"step": 0, **val})
    for step in range(1, t.total_training_steps + 1):
        metrics = engine.step(step)
        last = step == t.total_training_steps
        if last or (t.test_freq and step % t.test_freq == 0):
            metrics |= engine.validate()
        if on_step:
            on_step(step, metrics)
        history.append({"step": step, **metrics})
    return engine, history
