"""Stage time limits: each stage's recent wall times in this process, and the limit a pool
call of the stage runs under (max(pipeline.stage_timeout_s, pipeline.stage_timeout_factor x
the slowest of the stage's last 5 wall times)); past it the stage is declared hung and
`tasks.recovery` heals the pool."""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict, deque
from collections.abc import Iterator

from hybrid_engine import STAGES
from hybrid_engine.config import HybridConfig
from hybrid_engine.engine import Engine
from storage.store import RunStore


class StageClock:
    """Recent wall times of each stage in this process (a skipped stage counts with the wall
    time stored with it, so a resumed or recovered run is sized from the start)."""

    def __init__(self) -> None:
        self.walls: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=5))
        self._here = threading.local()  # per thread: a rollout may run beside the update

    @property
    def where(self) -> str:
        """The stage this thread runs now, e.g. "step-3/update"."""
        return getattr(self._here, "where", "")

    @where.setter
    def where(self, value: str) -> None:
        self._here.where = value

    @property
    def step(self) -> int:
        return getattr(self._here, "step", 0)

    @step.setter
    def step(self, value: int) -> None:
        self._here.step = value

    def record(self, stage: str, seconds: float) -> None:
        if seconds > 0:
            self.walls[stage].append(seconds)

    def seed(self, store: RunStore, step: int) -> None:
        """Stages without a wall time in this process (a resumed run) take those stored
        with the committed stages of the five steps before `step`."""
        for stage in (*STAGES, "validate"):
            if self.walls[stage]:
                continue
            for s in range(max(0, step - 5), step):
                if store.is_committed(s, stage):
                    try:  # a timing hint: a corrupted record is skipped (load_stage reports it)
                        meta = store.get_json(f"{store.stage_dir(s, stage)}/meta.json") or {}
                        self.record(stage, float(meta.get("wall_s", 0.0)))
                    except (ValueError, TypeError, OSError):
                        continue

    def limit(self, stage: str, cfg: HybridConfig) -> tuple[float, str]:
        """(seconds, how they were sized). Before the stage has a wall time of its own (its
        first run warms up): ray.call_timeout_s."""
        p = cfg.pipeline
        if not self.walls[stage]:
            return cfg.ray.call_timeout_s, f"ray.call_timeout_s: no {stage} timed yet"
        slowest = max(self.walls[stage])
        seconds = max(p.stage_timeout_s, p.stage_timeout_factor * slowest)
        return seconds, (
            f"max(pipeline.stage_timeout_s={p.stage_timeout_s:g}, "
            f"pipeline.stage_timeout_factor={p.stage_timeout_factor:g} x {slowest:.1f} s)"
        )


CLOCK = StageClock()


@contextlib.contextmanager
def stage_limit(engine: Engine, step: int, stage: str) -> Iterator[None]:
    """Run a stage under its time limit (pool only: in-process roles cannot hang apart)."""
    CLOCK.where, CLOCK.step = f"step-{step}/{stage}", step
    if engine.pool is None:
        yield
        return
    seconds, why = CLOCK.limit(stage, engine.cfg)
    with engine.pool.time_limit(seconds, why):
        yield
