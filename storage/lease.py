"""One writer per run: a lease in the run's storage, held by the driver that trains it.

    <run>/lease/<generation>.json    owner, host, pid, process start, since, heartbeat

The holder is the highest generation. A driver takes generation g + 1 with a conditional
create (`RunStore.create`: a local hard link; on S3 a PUT with `If-None-Match: *`), so of
two drivers racing for a run exactly one wins. The holder rewrites its heartbeat every
`storage.lease_timeout_s / 4`. Another driver of the run refuses (`LeaseHeld`, one line
naming the holder and since when) unless the holder is gone:

- on the holder's own host, at once when its process no longer lives (a SIGKILL, an
  OOM kill: the pid and its start time are checked, a reused pid is not mistaken for it);
- from another host, when its heartbeat is older than `storage.lease_timeout_s`.

A holder that finds a newer generation than its own (it stalled past the timeout and was
taken over), or whose last heartbeat that reached storage began more than `timeout_s -
bound_s` ago (a partition: every write it started has ended before a takeover), is lost
for good. `fence(store)` makes every write of the store that changes the run raise
LeaseHeld before it touches anything from then on, also in a pickled copy (which reads the
lease). The lease is marked released when the flow ends, and the store writes no more.
Heartbeats compare wall clocks of different hosts: they must agree to well within the
timeout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import psutil

from hybrid_engine.processes import alive
from storage.errors import LeaseHeld
from storage.probe import check_conditional_create
from storage.store import LEASE_DIR, RunStore

log = logging.getLogger("hybridrl.storage")
DIR = LEASE_DIR
__all__ = ["DIR", "LeaseHeld", "RunLease", "held_line", "refuse_if_trained"]
TAKEN = (
    "run {run}: another driver took this run over while this one stalled, or its driver "
    "ended (lease generation {gen}); this driver stops without writing more"
)


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def held_line(run_id: str, doc: dict[str, Any]) -> str:
    return (
        f"run {run_id} is being trained by pid {doc['pid']} on {doc['host']} since "
        f"{_when(doc['since'])} (heartbeat {time.time() - doc['heartbeat']:.0f} s ago)"
    )


def refuse_if_trained(store: RunStore, timeout_s: float, doing: str) -> None:
    """Raise LeaseHeld when a live driver holds the run (`doing`: what is refused)."""
    lease = RunLease(store, timeout_s)
    _, doc = lease.holder()
    if doc is not None and lease.gone(doc) is None:
        raise LeaseHeld(f"{held_line(store.run_id, doc)}; stop it before {doing}")


def _clock() -> float:
    """Seconds on a clock that also counts a suspended machine (Linux CLOCK_BOOTTIME)."""
    boot = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boot) if boot is not None else time.monotonic()


class RunLease:
    """The lease of `store`'s run for this process: `acquire()`, then `release()`; a
    context manager does both. `bound_s`: the longest one storage request may take with
    its retries (`StorageConfig.request_bound_s`); the holder stops writing by itself
    once its last heartbeat that reached storage began `timeout_s - bound_s` ago, so that
    every write it started has ended before another driver may take over."""

    def __init__(self, store: RunStore, timeout_s: float, bound_s: float = 0.0) -> None:
        self.store, self.timeout_s, self.bound_s = store, timeout_s, bound_s
        self.stop_after = timeout_s - bound_s
        self.renewed = 0.0  # `_clock()` when the last heartbeat that reached storage began
        self.why: str | None = None  # why the lease is lost, once it is
        me = psutil.Process()
        self.doc = {
            "owner": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": me.pid,
            "started": me.create_time(),
        }
        self.generation: int | None = None
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.remote = False  # a pickled copy (another process): it checks storage

    def __getstate__(self) -> dict[str, Any]:
        keep = ("store", "timeout_s", "bound_s", "doc", "generation")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["store"], state["timeout_s"], state["bound_s"])
        self.doc, self.generation, self.remote = state["doc"], state["generation"], True

    def fence(self, store: RunStore) -> None:
        """Make `store` refuse every write that changes the run once this lease is lost
        (and record its generation in the markers it writes), also when pickled."""
        store.guard, store.generation = self.check, self.generation

    # ---------------------------------------------------------------- reading
    def generations(self) -> list[int]:
        names = self.store.list(DIR)
        return sorted(
            int(n.removesuffix(".json")) for n in names if n.removesuffix(".json").isdigit()
        )

    def holder(self) -> tuple[int, dict[str, Any] | None]:
        """(highest generation or 0, its document or None)."""
        gens = self.generations()
        if not gens:
            return 0, None
        return gens[-1], self.store.get_json(f"{DIR}/{gens[-1]}.json")

    def gone(self, doc: dict[str, Any]) -> str | None:
        """Why the holder of `doc` no longer holds the run, or None while it does."""
        if doc.get("released"):
            return "released"
        if doc["host"] == socket.gethostname() and not alive(doc["pid"], doc["started"]):
            return f"its process (pid {doc['pid']}) is gone"
        age = time.time() - doc["heartbeat"]
        if age > self.timeout_s:
            return f"no heartbeat for {age:.0f} s (storage.lease_timeout_s={self.timeout_s:g})"
        return None

    # ---------------------------------------------------------------- holding
    def acquire(self, wait_s: float = 0, say: Any = None) -> str | None:
        """Take the run's lease, or raise LeaseHeld. A holder that still looks alive is
        waited for up to `wait_s` (a restart after a crash on another host: its heartbeat has
        to age past the timeout), with one line to `say`. Returns how an earlier holder's
        lease was taken over (None when there was none)."""
        if not self.store.cfg.single_driver:  # a store that cannot give one writer refuses
            check_conditional_create(self.store, f"{DIR}/probe-{self.doc['owner']}")
        deadline = time.monotonic() + wait_s
        for _ in range(5):  # a lost race re-reads the new holder
            gen, doc = self.holder()
            why = None
            if doc is not None:
                why = self.gone(doc)
                while why is None and time.monotonic() < deadline:
                    if say is not None:
                        say(
                            f"{held_line(self.store.run_id, doc)}: waiting up to {wait_s:g} s "
                            "for it to lapse"
                        )
                        say = None
                    time.sleep(min(5.0, self.timeout_s / 4))
                    gen, doc = self.holder()
                    why = "released" if doc is None else self.gone(doc)
                if why is None:
                    raise LeaseHeld(
                        f"{held_line(self.store.run_id, doc)}; a second driver would write "
                        "beside it: wait for it to end, or stop it first"
                    )
            began, now = _clock(), time.time()
            mine = {**self.doc, "since": now, "heartbeat": now}
            if self.store.create(f"{DIR}/{gen + 1}.json", json.dumps(mine).encode()):
                self.generation, self.doc, self.renewed = gen + 1, mine, began
                self.lost.clear()
                self.why = None
                self._start()
                for old in self.generations():  # keep the one before ours, for the record
                    if old < gen:
                        self.store.remove(f"{DIR}/{old}.json")
                if doc is not None and why != "released":
                    log.warning(
                        "run %s: took over the lease of pid %s on %s: %s",
                        self.store.run_id,
                        doc["pid"],
                        doc["host"],
                        why,
                    )
                return None if doc is None or why == "released" else why
        raise LeaseHeld(f"run {self.store.run_id}: lost the race for its lease five times")

    def _start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name="run-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        period = self.timeout_s / 4
        while not self._stop.wait(period):
            if self._lapsed():  # never taken up again: a takeover may be under way
                return
            try:
                began = _clock()
                if self.generations()[-1:] != [self.generation]:
                    gen, doc = self.holder()
                    log.error(
                        "run %s: the lease was taken over by pid %s on %s (generation %d)",
                        self.store.run_id,
                        (doc or {}).get("pid"),
                        (doc or {}).get("host"),
                        gen,
                    )
                    self._lose(TAKEN.format(run=self.store.run_id, gen=self.generation))
                    return
                self.doc["heartbeat"] = time.time()
                self._write()
                self.renewed = began
            except Exception as e:  # noqa: BLE001 - storage down: try again next period
                log.warning("run %s: lease heartbeat failed: %s", self.store.run_id, e)

    def _write(self) -> None:
        self.store.put(f"{DIR}/{self.generation}.json", json.dumps(self.doc).encode(), atomic=True)

    def _lose(self, why: str) -> None:
        if not self.lost.is_set():
            self.why = why
            self.lost.set()

    def _lapsed(self) -> bool:
        """Lost by itself: no heartbeat of its own reached storage within `stop_after`."""
        age = _clock() - self.renewed
        if not self.lost.is_set() and age > self.stop_after:
            log.error(
                "run %s: no lease heartbeat reached storage for %.0f s", self.store.run_id, age
            )
            self._lose(
                f"run {self.store.run_id}: another driver took this run over or may have: no "
                f"heartbeat of this driver reached storage for {age:.1f} s (it stops after "
                f"{self.stop_after:g} s: storage.lease_timeout_s={self.timeout_s:g} minus one "
                f"request's worst case, {self.bound_s:g} s); this driver stops without "
                "writing more"
            )
        return self.lost.is_set()

    def check(self) -> None:
        """Raise LeaseHeld when another driver took the run over, or may have (no heartbeat
        reached storage within `stop_after`). A pickled copy (a worker's store) reads the
        lease: its generation must still be the newest, held and heartbeating."""
        if self.remote and not self.lost.is_set():
            gen, doc = self.holder()
            stale = doc is not None and time.time() - doc["heartbeat"] > self.stop_after
            if gen != self.generation or doc is None or doc.get("released") or stale:
                self._lose(TAKEN.format(run=self.store.run_id, gen=self.generation))
        elif self.generation is not None and not self.lost.is_set():
            self._lapsed()
        if self.lost.is_set():
            raise LeaseHeld(self.why or TAKEN.format(run=self.store.run_id, gen=self.generation))

    def release(self) -> None:
        """Stop renewing; mark the lease released (when still ours)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.generation is None or self.lost.is_set():
            return
        with contextlib.suppress(Exception):
            if self.generations()[-1:] == [self.generation]:
                self.doc["released"] = time.time()
                self._write()
        self._lose(f"run {self.store.run_id}: this driver released its lease; it writes no more")
        self.generation = None

    def __enter__(self) -> RunLease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
