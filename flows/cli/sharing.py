"""`hybridrl pool status`'s part for a pool that runs share (`ray.when_busy=share`): the
attached runs, which run's stage holds the workers, each run's wait and share of the
workers' time (from the pool's scheduler, `hybrid_engine.pool.turns`)."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from flows.cli.runs import console


def run_line(r: dict[str, Any], offloaded: int = 0) -> Text:
    """One attached run: what it does now, then its turns, wait and held time so far, and in
    how many workers its parked state is offloaded to disk (past ray.max_resident_gb)."""
    if r["active"]:
        now = f"holds the workers for {r['stage'] or 'a pool call'} ({r['turn_s']:.1f} s)"
    elif r["waiting_s"]:
        now = f"waiting ({r['waiting_s']:.1f} s)"
    else:
        now = "between turns (driver-side work)"
    line = Text(f"  run {r['run']} (pid {r['pid']}, priority {r['priority']}): {now}")
    if r["over_slice"]:
        line.append(", past its ray.turn_slice_s", "red")
    line.append(
        f"; {r['turns']} turns, waited {r['waited_s']:.1f} s, held {r['held_s']:.1f} s "
        f"({100 * r['share']:.0f}% of the workers' busy time)"
    )
    if offloaded:
        line.append(f"; parked on disk in {offloaded} worker(s)")
    return line


def show_pool(table: Any, pool: str, workers: list[dict[str, Any]] = ()) -> None:
    """The workers' table, then the runs sharing the pool, if any, one line each."""
    from hybrid_engine.pool.sharing import runs_on

    console.print(table)
    runs = (runs_on(pool) or {}).get("runs") or []
    if runs:
        console.print(f"runs sharing pool {pool!r} (ray.when_busy=share):")
    for r in runs:
        offloaded = sum(
            s["offloaded"]
            for w in workers
            for s in w.get("runs", [])
            if s.get("owner") == r.get("owner")
        )
        console.print(run_line(r, offloaded), soft_wrap=True)
