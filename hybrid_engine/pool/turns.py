"""Whose stage holds the pool's workers: the one scheduler of a shared pool (`ray.when_busy:
share`), kept by the pool's claim actor (`hybrid_engine.pool.claim.Claim`), which runs one
call at a time.

Runs attach (refused in one line when a must-match field of the pool spec differs from the
attached runs', or past `ray.max_runs`), then ask for a turn before each stage's pool work
and give it back after. Of the runs waiting, the highest `ray.priority` goes first, then the
one that asked first: a run that just had a turn asks again behind those already waiting
(round robin at stage boundaries). A run whose driver is gone (its process dead on the
claim's host, or no renewal for its `ray.claim_timeout_s`, the liveness rules of the one-run
claim) is detached, and its turn released, at the next call of any run.

Times are this object's own monotonic clock (never a driver's)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any


class Turns:
    """The attached runs of one pool and its turn queue."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {}  # owner -> who + bookkeeping
        self.spec: dict[str, Any] | None = None  # the must-match part of the runs' pool spec
        self.active: str | None = None  # owner of the run whose stage holds the workers
        self.granted = 0.0  # monotonic time the active turn started
        self.detached: dict[str, str] = {}  # owner -> why it was detached
        self._seq = itertools.count()

    # ------------------------------------------------------------------ runs
    def attach(
        self,
        who: dict[str, Any],
        spec: dict[str, Any],
        max_runs: int,
        gone: Callable[[dict], str | None],
    ) -> str | None:
        """Attach run `who` (owner, run, host, pid, started, timeout_s, priority, slice_s);
        the refusal (one line, without the pool's name) or None."""
        self.prune(gone)
        owner = who["owner"]
        if owner not in self.runs:
            if self.runs and self.spec is not None:
                for key in spec:
                    if self.spec.get(key) != spec[key]:
                        return (
                            f"is shared by run(s) {self.names()} built with another {key} "
                            f"(pool has {self.spec.get(key)!r}, this run asks {spec[key]!r}); "
                            f"runs share a pool only when {key} matches: set it alike, or "
                            "use another ray.pool_name"
                        )
            if len(self.runs) >= max_runs:
                return (
                    f"has {len(self.runs)} run(s) attached ({self.names()}), "
                    f"ray.max_runs={max_runs}: wait for one to end, or use another "
                    "ray.pool_name"
                )
        now = time.monotonic()
        old = self.runs.get(owner, {})
        self.runs[owner] = {
            **who,
            "since": old.get("since", time.time()),
            "attached": old.get("attached", now),
            "renewed": now,
            "waiting": old.get("waiting"),  # (seq, since) while it waits for a turn
            "waited_s": old.get("waited_s", 0.0),
            "held_s": old.get("held_s", 0.0),
            "turns": old.get("turns", 0),
            "label": old.get("label"),
        }
        self.spec = spec if self.spec is None or len(self.runs) == 1 else self.spec
        self.detached.pop(owner, None)
        return None

    def renew(self, owner: str) -> str | None:
        """Renew run `owner`; why it is detached, when it is."""
        if owner not in self.runs:
            return self.detached.get(owner, "it is not attached")
        self.runs[owner]["renewed"] = time.monotonic()
        return None

    def detach(self, owner: str, why: str = "it detached") -> None:
        if self.active == owner:
            self.done(owner)
        if self.runs.pop(owner, None) is not None:
            self.detached[owner] = why
        if not self.runs:
            self.spec = None

    def prune(self, gone: Callable[[dict], str | None]) -> list[str]:
        """Detach every run whose driver is gone; their names."""
        out = []
        for owner, r in list(self.runs.items()):
            if (why := gone(self.shown(owner))) is not None:
                self.detach(owner, why)
                out.append(f"{r['run']} ({why})")
        return out

    # ------------------------------------------------------------------ turns
    def request(self, owner: str, label: str, gone: Callable[[dict], str | None]) -> dict[str, Any]:
        """Run `owner` asks for the workers (for stage `label`): {granted, detached (why,
        or None), live (owners attached), holder (the active run shown), over_slice}."""
        self.prune(gone)
        if owner not in self.runs:
            why = self.detached.get(owner, "it is not attached")
            return {"granted": False, "detached": why, "live": [], "holder": None}
        me, now = self.runs[owner], time.monotonic()
        me["renewed"] = now
        if self.active != owner and me["waiting"] is None:
            me["waiting"] = (next(self._seq), now)
        if self.active is None:
            waiting = [o for o, r in self.runs.items() if r["waiting"] is not None]
            self._grant(
                min(waiting, key=lambda o: (-self.runs[o]["priority"], self.runs[o]["waiting"][0])),
                now,
            )
        if self.active == owner:
            me["label"] = label
        holder = self.shown(self.active) if self.active else None
        return {
            "granted": self.active == owner,
            "detached": None,
            "live": list(self.runs),
            "holder": holder,
            "over_slice": bool(holder and holder["over_slice"]),
        }

    def _grant(self, owner: str, now: float) -> None:
        r = self.runs[owner]
        r["waited_s"] += now - r["waiting"][1]
        r["waiting"], r["turns"] = None, r["turns"] + 1
        self.active, self.granted = owner, now

    def done(self, owner: str) -> None:
        """Run `owner` gives the workers back at a stage boundary."""
        if self.active != owner:
            return
        r = self.runs.get(owner)
        if r is not None:
            r["held_s"] += time.monotonic() - self.granted
            r["label"] = None
        self.active = None

    # ------------------------------------------------------------------ status
    def names(self) -> str:
        return ", ".join(r["run"] for r in self.runs.values())

    def shown(self, owner: str) -> dict[str, Any]:
        """Run `owner` as `pool status` and the liveness rules read it: who it is, `age_s`
        since its last renewal, its wait so far, its turns and share of the held time."""
        r, now = self.runs[owner], time.monotonic()
        held = r["held_s"] + (now - self.granted if self.active == owner else 0.0)
        total = sum(x["held_s"] for x in self.runs.values()) + (
            now - self.granted if self.active else 0.0
        )
        waiting = [o for o, x in self.runs.items() if x["waiting"] is not None]
        turn_s = now - self.granted if self.active == owner else 0.0
        keys = ("owner", "run", "host", "pid", "started", "timeout_s", "priority", "since")
        return {
            **{k: r.get(k) for k in keys},
            "age_s": now - r["renewed"],
            "active": self.active == owner,
            "stage": r["label"] if self.active == owner else None,
            "turn_s": turn_s,
            "over_slice": bool(waiting) and turn_s > r.get("slice_s", float("inf")),
            "waiting_s": now - r["waiting"][1] if r["waiting"] is not None else 0.0,
            "waited_s": r["waited_s"] + (now - r["waiting"][1] if r["waiting"] else 0.0),
            "held_s": held,
            "share": held / total if total > 0 else 0.0,
            "turns": r["turns"],
        }

    def read(self) -> list[dict[str, Any]]:
        return [self.shown(o) for o in self.runs]
