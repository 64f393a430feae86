"""A driver's side of a shared pool (`ray.when_busy=share`): its run attached to the pool's
scheduler (`hybrid_engine.pool.turns`, kept by the claim actor) and its turns.

    claim = claim_pool(cfg)            # (this module's) attach: refused in one line past ray.max_runs, or
                                       # when a must-match field differs (worker.SHARED)
    with claim.turn("step-3/rollout"): # wait for the workers, swap this run's slot in
        ...                            # (hybrid_engine.pool.slots), call them
    claim.release()                    # detach; the workers free the run's slot

A turn is re-entrant: a stage task takes one around its pool work (tasks.stages), and a pool
call made outside any turn (a checkpoint, the final export) takes a turn of its own. The
wait and the switch (swapping the run's slot in on every worker) are added up for the step's
metrics (`timing_s/pool_wait`, `timing_s/pool_switch`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray

from hybrid_engine.pool.claim import PoolBusy, PoolClaim, PoolTaken, driver_id

log = logging.getLogger("hybridrl.pool")
POLL_S = 0.1  # how often a waiting driver asks the claim actor for its turn


class SharedClaim(PoolClaim):
    """This run's place on a shared pool: attached once, then a turn per stage."""

    def __init__(self, cfg: Any) -> None:
        from hybrid_engine.pool.worker import pool_spec, shared_spec

        r = cfg.ray
        super().__init__(
            r.pool_name, f"hybridrl-{r.pool_name}", cfg.trainer.run_id, r.claim_timeout_s
        )
        self.cfg = cfg
        self.who = {
            **driver_id(cfg.trainer.run_id, per_run=True),
            "timeout_s": r.claim_timeout_s,
            "priority": r.priority,
            "slice_s": r.turn_slice_s,
        }
        self.owner = self.who["owner"]
        # the workers' bound is the pool's: every run must give the same
        self.spec = shared_spec(pool_spec(cfg)) | {"ray.max_resident_gb": r.max_resident_gb}
        self.groups: list[Any] = []  # the pool's worker groups (`bind`)
        self._lock = threading.Lock()
        self._depth = 0
        self._granted = threading.Event()
        self._leading = False  # a thread of this run is asking for the turn
        self.totals = {"timing_s/pool_wait": 0.0, "timing_s/pool_switch": 0.0}

    def take(self, wait: bool = False, say: Any = log.warning) -> None:
        """Attach to the pool's scheduler; PoolBusy (one line) when it refuses this run."""
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if len(nodes) > 1:
            raise PoolBusy(
                f"ray.when_busy=share on a cluster of {len(nodes)} nodes: sharing a multi-node "
                "pool is not built yet; use ray.when_busy=refuse or wait"
            )
        line = ray.get(
            self.actor.attach.remote(self.who, self.spec, self.cfg.ray.max_runs), timeout=30
        )
        if line is not None:
            raise PoolBusy(f"pool {self.pool!r} {line}")
        self.keep_renewing()

    def _renew(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            try:
                why = ray.get(self.actor.renew_run.remote(self.owner), timeout=30)
            except Exception as e:  # noqa: BLE001 - the head is unreachable: next period
                log.warning("pool %r: renewing the run's place failed: %s", self.pool, e)
                continue
            if why is not None:
                self.taken_by = {"why": why}
                return

    def check(self) -> None:
        if self.taken_by is not None:
            raise PoolTaken(
                f"pool {self.pool!r}: run {self.who['run']} was detached from the pool "
                f"({self.taken_by['why']}); this run stops here (resume it)"
            )

    def bind(self, groups: list[Any]) -> None:
        """The pool's groups, whose workers swap this run's slot in at each turn."""
        self.groups = list(groups)

    @contextlib.contextmanager
    def turn(self, label: str = "call") -> Iterator[None]:
        """Hold the pool's workers for this run (re-entrant, across this run's threads)."""
        with self._lock:
            self._depth += 1
            lead = not self._leading and not self._granted.is_set()
            self._leading |= lead
        try:
            while not self._granted.is_set():  # one thread asks; the others wait for it
                if lead:
                    try:
                        self._wait_turn(label)
                        self._granted.set()
                    finally:
                        with self._lock:
                            self._leading = False
                else:
                    self._granted.wait(0.5)
                    with self._lock:  # the asking thread failed: this one asks
                        lead = not self._granted.is_set() and not self._leading
                        self._leading |= lead
            yield
        finally:
            with self._lock:
                self._depth -= 1
                last = self._depth == 0
            if last:
                self._granted.clear()
                with contextlib.suppress(Exception):
                    ray.get(self.actor.done.remote(self.owner), timeout=30)

    def _wait_turn(self, label: str) -> None:
        start, warned = time.monotonic(), None
        while True:
            self.check()
            got = ray.get(self.actor.request.remote(self.owner, label), timeout=30)
            if got["detached"] is not None:
                self.taken_by = {"why": got["detached"]}
                self.check()
            if got["granted"]:
                break
            h = got["holder"]
            if got["over_slice"] and warned != (h["owner"], h["turns"]):
                warned = (h["owner"], h["turns"])
                log.warning(
                    "pool %r: run %s has held the workers for %.0f s (%s; its ray.turn_slice_s "
                    "passed) while run %s waits",
                    self.pool,
                    h["run"],
                    h["turn_s"],
                    h["stage"],
                    self.who["run"],
                )
            time.sleep(POLL_S)
        self.totals["timing_s/pool_wait"] += time.monotonic() - start
        switch = time.perf_counter()
        for g in self.groups:
            g.wait([h.activate.remote(self.owner, got["live"]) for h in g.handles], "activate")
        self.totals["timing_s/pool_switch"] += time.perf_counter() - switch

    def step_metrics(self) -> dict[str, float]:
        """The wait for turns and the switches since the last call (a step's update)."""
        out, self.totals = self.totals, dict.fromkeys(self.totals, 0.0)
        return out

    def release(self) -> None:
        """Detach: the workers free this run's slot, the scheduler forgets it."""
        self._stop.set()
        for g in self.groups:
            with contextlib.suppress(Exception):
                ray.get([h.leave.remote(self.owner) for h in g.handles], timeout=60)
        with contextlib.suppress(Exception):
            ray.get(self.actor.detach.remote(self.owner), timeout=30)


def claim_pool(cfg: Any, say: Any = log.warning) -> PoolClaim:
    """Connect to Ray and take this run's place on `ray.pool_name`: attached beside the
    runs sharing it (`ray.when_busy=share`), else the one-run claim (refuse, or wait)."""
    from hybrid_engine.pool import claim
    from hybrid_engine.pool.cluster import connect

    if cfg.ray.when_busy != "share":
        return claim.claim_pool(cfg, say)
    connect(cfg)
    shared = SharedClaim(cfg)
    shared.take(say=say)
    return shared


def runs_on(pool: str) -> dict[str, Any] | None:
    """The runs attached to shared pool `pool` ({runs, active}; Ray connected), or None."""
    try:
        actor = ray.get_actor("claim", namespace=f"hybridrl-{pool}")
        return ray.get(actor.runs.remote(), timeout=30)
    except (ValueError, ray.exceptions.RayActorError, AttributeError):
        return None
