"""Crashed drivers come back, within a budget.

A training deployment's trigger on its flow runs' Crashed state (deployments/prefect.yaml)
runs the flow again with `resume_from=<run id>` and `restarted=<n>`: the crashed flow run's
own `restarted` plus one, so `n` counts the restarts in a row since a person or a schedule
started the run, whatever point each driver died at (before run.json existed, before the
flow body ran). Such a restart waits for the dead driver's lease to lapse (at once on the
same host; after `storage.lease_timeout_s` from another), marks that driver's MLflow run
FAILED (the restart reopens it as it goes on), and counts against
`pipeline.max_driver_restarts`: the restarts in a row that found no update committed since
the one before (run.json's `driver_restarts` records the last count and the update it saw,
`driver_chain` that driver's `n`). One more refuses in one line, before the engine starts, and the flow run ends
Failed, which no trigger resumes. A person's `hybridrl resume` starts the count again.
"""

from __future__ import annotations

from typing import Any

from storage.store import RunStore
from tasks.checkpoint import last_committed_update


class CrashLoop(RuntimeError):
    """A run's driver died more often in a row than pipeline.max_driver_restarts allows."""


def chain_number(run_doc: dict[str, Any], restarted: bool | int) -> int:
    """This driver's place in its chain of restarts (0: started by a person or a schedule).
    `restarted`: the trigger's count; `true` (an older trigger): one more than the last
    driver's."""
    if not isinstance(restarted, bool):
        return max(0, int(restarted))
    last = run_doc.get("driver_chain", (run_doc.get("driver_restarts") or {}).get("count", 0))
    return last + 1 if restarted else 0


def count_restart(
    store: RunStore, run_doc: dict[str, Any], limit: int, restarted: bool | int
) -> dict[str, int]:
    """The run's restart record for run.json: `count` restarts in a row at update `step`
    (`run_doc`: run.json as the last driver left it, {} before it existed). Raises CrashLoop
    when this restart is one more than `limit`."""
    done = last_committed_update(store)
    n = chain_number(run_doc, restarted)
    if n == 0:
        return {"count": 0, "step": done}
    before = run_doc.get("driver_restarts") or {}
    # restarts since the last driver that recorded: the ones in between died first
    since = n - min(run_doc.get("driver_chain", before.get("count", 0)), n - 1)
    progressed = done > before.get("step", -1)
    count = (0 if progressed else before.get("count", 0)) + since
    if count > limit:
        times = f"{count} time{'s' if count > 1 else ''}"
        raise CrashLoop(
            f"run {store.run_id}: its driver died {times} in a row without committing an "
            f"update (last: step {done}; pipeline.max_driver_restarts={limit}), so it is not "
            f"restarted again; read the crashed flow runs' logs, then "
            f"`hybridrl resume {store.run_id}`"
        )
    return {"count": count, "step": done}
