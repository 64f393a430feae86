"""Self-healing: what the `train` flow does when a worker dies or hangs, or the driver is told
to stop.

    stage_limit(engine, stage)   a pool call of the stage that takes longer than
                                 max(pipeline.stage_timeout_s, pipeline.stage_timeout_factor x
                                 the slowest of the stage's last 5 wall times) is declared hung
    Recovery.handle(error)       a dead or hung worker: count it, record it, back off, re-create
                                 the pool; the flow then restores the last checkpoint and goes
                                 on from the first uncommitted stage (committed updates are
                                 replayed). Past pipeline.max_recoveries: RecoveryExhausted.
    preemption()                 SIGTERM raises Preempted in the flow's thread; a commit in
                                 progress finishes first (storage.store.critical), nothing is
                                 left half-committed, the flow run ends in state "Preempted"

Every stage is idempotent and committed, so a recovery loses at most the stage in progress.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import Any

import psutil

from hybrid_engine import STAGES
from hybrid_engine.config import HybridConfig
from hybrid_engine.engine import Engine
from hybrid_engine.errors import STOPPING, WorkerLostError
from storage.store import RunStore, critical

log = logging.getLogger("hybridrl.recovery")


class RecoveryExhausted(RuntimeError):
    """More worker faults than pipeline.max_recoveries: the run stops; a resume continues it."""


class Preempted(BaseException):
    """SIGTERM reached the driver. A BaseException, like KeyboardInterrupt: no `except
    Exception` on the way (a task's retry, a library's fallback) may swallow it."""


# ---------------------------------------------------------------------- stage time limits
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


# -------------------------------------------------------------------------- recovery
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


# ------------------------------------------------------------------------- preemption
@contextlib.contextmanager
def preemption() -> Iterator[None]:
    """While the block runs, SIGTERM raises Preempted in this thread (after a commit in
    progress, which `critical()` holds it back for). Off the main thread (where Python
    cannot take signals) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        _term_at[:] = [CLOCK.where or "start-up"]
        STOPPING.set()  # a rollout waited for in another thread gives up
        critical.pending = True
        if not critical.depth:
            critical.pending = False
            raise Preempted(f"SIGTERM at {CLOCK.where or 'start-up'}")

    STOPPING.clear()
    _term_at.clear()
    before = signal.signal(signal.SIGTERM, on_term)
    critical.on_exit = _raise_pending
    _armed.append(on_term)
    try:
        yield
    finally:
        _armed.remove(on_term)
        signal.signal(signal.SIGTERM, before)
        critical.on_exit = None


_armed: list[Any] = []
_term_at: list[str] = []  # where the SIGTERM of this `preemption()` block arrived


def as_preempted(e: BaseException) -> Preempted | None:
    """`e` as the preemption it is: Preempted itself, or the error Prefect's engine made of
    it when the SIGTERM landed inside the engine's own code (a task run's state handling
    raises e.g. "Task run is not set"); None when no SIGTERM arrived."""
    if isinstance(e, Preempted):
        return e
    if _term_at:
        return Preempted(f"SIGTERM at {_term_at[0]} ({type(e).__name__} in Prefect's engine)")
    return None


def rearm() -> None:
    """Put our SIGTERM handler back (`ray.init` installs its own, which exits the process)."""
    if _armed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _armed[-1])


def _raise_pending() -> None:
    if critical.pending:
        critical.pending = False
        raise Preempted(f"SIGTERM at {CLOCK.where or 'start-up'}")


# ------------------------------------------------- what a killed driver left behind
def driver_record() -> dict[str, Any]:
    """This driver and the servers it started (Prefect's ephemeral API is a child process):
    kept in run.json, so the next driver of the run can end what a SIGKILL left running."""
    me = psutil.Process()
    servers = []
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(child.cmdline())
            if "uvicorn" in cmd or "prefect" in cmd:
                servers.append({"pid": child.pid, "started": child.create_time()})
    return {
        "host": socket.gethostname(),
        "pid": me.pid,
        "started": me.create_time(),
        "servers": servers,
    }


def clean_up_after(previous: dict[str, Any] | None) -> list[int]:
    """End the servers a dead driver of this run left on this machine (same pid and start
    time: a reused pid is left alone). Returns the pids ended."""
    if not previous or previous.get("host") != socket.gethostname():
        return []
    if _alive(previous["pid"], previous["started"]):
        return []  # that driver still runs (another resume of the same run?): not ours to end
    ended = []
    for server in previous.get("servers", []):
        if _alive(server["pid"], server["started"]):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(server["pid"])
                proc.terminate()
                try:
                    proc.wait(10)
                except psutil.TimeoutExpired:
                    proc.kill()
                ended.append(server["pid"])
    if ended:
        log.warning(
            "ended the Prefect server process(es) %s left by the killed driver (pid %d)",
            ended,
            previous["pid"],
        )
    return ended


def _alive(pid: int, started: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.Error:
        return False
