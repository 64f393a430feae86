"""One run per pool: the pool's claim, a detached actor named `claim` in the pool's namespace.

The train flow's driver claims the pool before it attaches to, resets or creates its
workers, and releases it when the flow ends (an `Engine` built directly claims nothing). The actor
runs one call at a time, so a claim is a compare-and-set: of two drivers, one holds the pool.
The holder renews every `ray.claim_timeout_s / 4` from a thread. Another driver (another
process) is refused in one line naming the run that holds the pool, or waits for it with
`ray.when_busy: wait`, unless the holder is gone: its process dead on this host (at once), or
no renewal for `ray.claim_timeout_s`. A holder that finds the pool claimed by someone else
(it stalled past the timeout) stops with `PoolTaken` at its next call.

The claim's age is measured by the actor on its own monotonic clock (never a driver's
clock against the actor node's), and the actor lives on the head node (`HEAD`): in a
cluster whose drivers join as nodes (the KubeRay recipe's flow-run Job), a driver's node
dies with its driver, and a claim placed there would go with it.

The workers also remember the driver that configured them last (`driver_id`): a call from
another driver, e.g. one that ignores claims, is refused in the worker with `PoolTaken`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from datetime import UTC, datetime
from typing import Any

import psutil
import ray

from hybrid_engine.pool.turns import Turns
from hybrid_engine.processes import alive

log = logging.getLogger("hybridrl.pool")
NAME = "claim"
HEAD = {"node:__internal_head__": 0.001}  # the head node's own resource, in every Ray cluster


class PoolBusy(RuntimeError):
    """Another run holds the pool."""


class PoolTaken(RuntimeError):
    """This driver's pool was claimed by another run while it stalled."""


@ray.remote(num_cpus=0)
class Claim:
    """Who holds the pool: {owner, run, host, pid, started, timeout_s, since, age_s} or None;
    `age_s`, the time since the holder's last renewal, on this actor's monotonic clock."""

    def __init__(self) -> None:
        self.holder: dict[str, Any] | None = None
        self.renewed = 0.0  # time.monotonic() of the holder's last renewal
        self.turns = Turns()  # the runs sharing the pool (ray.when_busy=share)

    def _shown(self) -> dict[str, Any] | None:
        h = self.holder
        return None if h is None else {**h, "age_s": time.monotonic() - self.renewed}

    def take(self, who: dict[str, Any], unless: str | None) -> dict[str, Any] | None:
        """Hold the pool for `who` unless another owner holds it (and is not `unless`, a
        holder the caller found gone); returns that holder, else None."""
        h = self.holder
        if h is not None and h["owner"] not in (who["owner"], unless):
            return self._shown()
        self.turns.prune(gone)
        if self.turns.runs:  # shared runs hold it: shown as the first of them
            return self.turns.read()[0]
        since = h["since"] if h is not None and h["owner"] == who["owner"] else time.time()
        self.holder, self.renewed = {**who, "since": since}, time.monotonic()
        return None

    def renew(self, owner: str) -> dict[str, Any] | None:
        """Renew; the holder when it is not `owner` any more."""
        if self.holder is None or self.holder["owner"] != owner:
            return self._shown()
        self.renewed = time.monotonic()
        return None

    def release(self, owner: str) -> None:
        if self.holder is not None and self.holder["owner"] == owner:
            self.holder = None

    def read(self) -> dict[str, Any] | None:
        return self._shown()

    # a shared pool (ray.when_busy=share): `hybrid_engine.pool.turns` schedules its runs
    def attach(self, who: dict[str, Any], spec: dict[str, Any], max_runs: int) -> str | None:
        """Attach a run to share the pool; the refusal (one line), or None."""
        h = self._shown()
        if h is not None and gone(h) is None and h["owner"] != who["owner"]:
            return (
                f"is used by run {h['run']} (pid {h['pid']} on {h['host']}) alone (its "
                "ray.when_busy is not share): wait for it to end, or use another ray.pool_name"
            )
        self.holder = None
        return self.turns.attach(who, spec, max_runs, gone)

    def request(self, owner: str, label: str) -> dict[str, Any]:
        return self.turns.request(owner, label, gone)

    def done(self, owner: str) -> None:
        self.turns.done(owner)

    def renew_run(self, owner: str) -> str | None:
        return self.turns.renew(owner)

    def detach(self, owner: str) -> None:
        self.turns.detach(owner)

    def runs(self) -> dict[str, Any]:
        """The attached runs (`Turns.shown`), dead ones detached first."""
        self.turns.prune(gone)
        return {"runs": self.turns.read(), "active": self.turns.active}


def driver_id(run: str | None, per_run: bool = False) -> dict[str, Any]:
    """This process as a driver: {owner, run, host, pid, started}; `owner` is unique (with
    `per_run`, per run of the process: runs sharing a pool)."""
    me = psutil.Process()
    tail = f"/{run}" if per_run else ""
    return {
        "owner": f"{socket.gethostname()}:{me.pid}:{me.create_time():.3f}{tail}",
        "run": run or "(no run id)",
        "host": socket.gethostname(),
        "pid": me.pid,
        "started": me.create_time(),
    }


def driver_line(d: dict[str, Any] | None) -> str:
    if d is None:
        return "a driver that does not claim pools (an older hybridrl, or an Engine built directly)"
    return f"run {d['run']} (pid {d['pid']} on {d['host']})"


def taken(pool: str, worker: str, holder: dict[str, Any] | None, run: str) -> PoolTaken:
    """The refusal a driver gets from a worker that `holder` configured after it."""
    return PoolTaken(
        f"pool {pool!r}: worker {worker} was configured by {driver_line(holder)} while run "
        f"{run} used it; that run stops here (resume it when the pool is free, or on another "
        "ray.pool_name)"
    )


def gone(h: dict[str, Any]) -> str | None:
    """Why holder `h` no longer holds the pool, or None while it does."""
    if h["host"] == socket.gethostname() and not alive(h["pid"], h["started"]):
        return f"its process (pid {h['pid']}) is gone"
    # on the claim actor's clock (a claim actor of an older hybridrl gives its wall time)
    age = h["age_s"] if "age_s" in h else time.time() - h["renewed"]
    limit = h["timeout_s"]
    if age > limit:
        return f"not renewed for {age:.0f} s (its ray.claim_timeout_s={limit:g})"
    return None


def live_holder(pool: str) -> dict[str, Any] | None:
    """The run holding pool `pool` now, if any (Ray connected)."""
    try:
        actor = ray.get_actor(NAME, namespace=f"hybridrl-{pool}")
        h = ray.get(actor.read.remote(), timeout=30)
        if h is None or gone(h) is not None:  # runs sharing it: the first of them
            h = next(iter(ray.get(actor.runs.remote(), timeout=30)["runs"]), None)
    except (ValueError, ray.exceptions.RayActorError):
        return None
    return h if h is not None and gone(h) is None else None


def holder_line(pool: str, h: dict[str, Any]) -> str:
    since = datetime.fromtimestamp(h["since"], UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"pool {pool!r} is used by run {h['run']} (pid {h['pid']} on {h['host']}, since {since})"


class PoolClaim:
    """This process's claim on pool `pool` (namespace `namespace`)."""

    def __init__(self, pool: str, namespace: str, run: str | None, timeout_s: float) -> None:
        self.pool, self.timeout_s = pool, timeout_s
        self.who = {**driver_id(run), "timeout_s": timeout_s}
        self.actor = Claim.options(
            name=NAME, namespace=namespace, lifetime="detached", get_if_exists=True, resources=HEAD
        ).remote()
        self.taken_by: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, wait: bool, say: Any = log.warning) -> None:
        """Hold the pool; PoolBusy (or, with `wait`, wait and say so every minute)."""
        said = 0.0
        while True:
            h = ray.get(self.actor.take.remote(self.who, None), timeout=30)
            if h is not None and (why := gone(h)) is not None:
                h = ray.get(self.actor.take.remote(self.who, h["owner"]), timeout=30)
                if h is None:
                    log.warning("pool %r: taken over from its last holder: %s", self.pool, why)
            if h is None:
                break
            line = holder_line(self.pool, h)
            if "turns" in h:  # runs share it (ray.when_busy=share)
                line = f"{line}, shared by its runs: ray.when_busy=share joins them"
            if not wait:
                raise PoolBusy(
                    f"{line}; a second run would disturb it: use another ray.pool_name, or "
                    "ray.when_busy=wait to wait for it"
                )
            if time.monotonic() - said > 60:
                say(f"{line}: waiting for it (ray.when_busy=wait)")
                said = time.monotonic()
            time.sleep(2)
        self.keep_renewing()

    def keep_renewing(self) -> None:
        """Renew from a thread every `timeout_s / 4` (started once; again after `release`)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._renew, name="pool-claim", daemon=True)
            self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            try:
                h = ray.get(self.actor.renew.remote(self.who["owner"]), timeout=30)
            except Exception as e:  # noqa: BLE001 - the head is unreachable: next period
                log.warning("pool %r: renewing the claim failed: %s", self.pool, e)
                continue
            if h is not None:
                self.taken_by = h
                return

    def check(self) -> None:
        """PoolTaken when another run claimed the pool from under this one."""
        if self.taken_by is not None:
            raise PoolTaken(
                f"{holder_line(self.pool, self.taken_by)} now: it claimed the pool while this "
                "driver stalled; this run stops here (resume it on another ray.pool_name)"
            )

    def turn(self, label: str = "call") -> contextlib.AbstractContextManager[None]:
        """A run alone on the pool holds it all along (runs sharing one: `SharedClaim`)."""
        return contextlib.nullcontext()

    def release(self) -> None:
        self._stop.set()
        if self.taken_by is None:
            try:
                ray.get(self.actor.release.remote(self.who["owner"]), timeout=30)
            except Exception as e:  # noqa: BLE001 - a head already gone releases everything
                log.debug("pool %r: release: %s", self.pool, e)


def claim_pool(cfg: Any, say: Any = log.warning) -> PoolClaim:
    """Connect to Ray and hold `ray.pool_name` for run `trainer.run_id` (`ray.when_busy`:
    refuse with PoolBusy, or wait)."""
    from hybrid_engine.pool.cluster import connect

    connect(cfg)
    r = cfg.ray
    if r.when_busy == "share":
        raise ValueError("ray.when_busy=share: attach with hybrid_engine.pool.sharing.claim_pool")
    claim = PoolClaim(r.pool_name, f"hybridrl-{r.pool_name}", cfg.trainer.run_id, r.claim_timeout_s)
    claim.take(wait=r.when_busy == "wait", say=say)
    return claim
