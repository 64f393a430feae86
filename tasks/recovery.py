"""Self-healing: what the `train` flow does when a worker dies or hangs.

    Recovery.handle(error)   a dead or hung worker (a stage past its limit,
                             `tasks.stage_clock`): count it, record it, back off, re-create
                             the pool; the flow then restores the last checkpoint and goes
                             on from the first uncommitted stage (committed updates are
                             replayed). Past pipeline.max_recoveries: RecoveryExhausted.

Every stage is idempotent and committed, so a recovery loses at most the stage in progress.
SIGTERM is `tasks.preemption`; servers a killed driver left, `tasks.driver_cleanup`.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

from hybrid_engine.config import HybridConfig
from hybrid_engine.engine import Engine
from hybrid_engine.errors import WorkerLostError
from storage.store import RunStore, critical
from tasks.stage_clock import CLOCK

log = logging.getLogger("hybridrl.recovery")


class RecoveryExhausted(RuntimeError):
    """More worker faults than pipeline.max_recoveries: the run stops; a resume continues it."""


class Recovery:
    """Counts and records worker faults of one flow run, and heals the pool after each."""

    def __init__(self, cfg: HybridConfig, store: RunStore) -> None:
        self.cfg, self.store = cfg, store
        self.events: list[dict[str, Any]] = []

    @property
    def count(self) -> int:
        return len(self.events)

    def handle(self, error: WorkerLostError, engine: Engine) -> dict[str, Any]:
        """Record the fault; past pipeline.max_recoveries raise RecoveryExhausted, else back
        off and re-create the pool. Returns the event."""
        p = self.cfg.pipeline
        where, step = error.where or (CLOCK.where, CLOCK.step)
        event = {
            "at": time.time(),
            "where": where,
            "step": step,
            "worker": error.worker,
            "how": error.how,
            "error": str(error),
        }
        self.events.append(event)
        self._record()
        if self.count > p.max_recoveries:
            seen: dict[str, int] = defaultdict(int)
            for e in self.events:
                seen[f"{e['worker']} {e['how']}"] += 1
            what = ", ".join(f"{k} {n}x" for k, n in seen.items())
            raise RecoveryExhausted(
                f"{what}: {self.count} worker faults, more than pipeline.max_recoveries="
                f"{p.max_recoveries}; the run stopped at {where} with every committed "
                f"stage kept. Continue it with `hybridrl resume {self.store.run_id}`"
            ) from None
        if self.cfg.ray.when_busy == "share":  # the other runs' state lives in those workers
            raise RecoveryExhausted(
                f"{error}: re-creating a pool that runs share (ray.when_busy=share) is not "
                f"built yet; the run stopped at {where} with every committed stage kept. "
                f"Continue it with `hybridrl resume {self.store.run_id}`"
            ) from None
        delay = p.recovery_delay_s * 2 ** (self.count - 1)
        log.warning(
            "recovery %d/%d: %s; re-creating the pool in %.0f s",
            self.count,
            p.max_recoveries,
            error,
            delay,
        )
        time.sleep(delay)
        start = time.perf_counter()
        removed = engine.recreate_pool()
        event["rebuild_s"] = time.perf_counter() - start
        event["removed"] = removed
        self._record()
        log.warning(
            "recovery %d: pool %r re-created in %.1f s (removed %s); restoring the last checkpoint",
            self.count,
            self.cfg.ray.pool_name,
            event["rebuild_s"],
            ", ".join(removed) or "nothing",
        )
        return event

    def _record(self) -> None:
        """The events in run.json (`recoveries`), rewritten after each change (a run not
        recorded yet gets them with its next change)."""
        doc = self.store.read_run()
        if doc is None:
            return
        kept = [e for e in doc.get("recoveries", []) if e.get("flow_run") != self._flow_run()]
        mine = [{**e, "flow_run": self._flow_run()} for e in self.events]
        with critical():
            self.store.write_run({**doc, "recoveries": kept + mine})

    @staticmethod
    def _flow_run() -> str | None:
        from prefect.runtime import flow_run

        return flow_run.id
