"""Crashed drivers come back, within a budget.

A training deployment's trigger on its flow runs' Crashed state (deployments/prefect.yaml)
runs the flow again with `resume_from=<run id>` and `restarted=true`. Such a restart waits
for the dead driver's lease to lapse (at once on the same host; after
`storage.lease_timeout_s` from another), marks that driver's MLflow run FAILED (the restart
reopens it as it goes on), and counts against `pipeline.max_driver_restarts`: the restarts
in a row that found no update committed since the one before. One more refuses in one line,
and the flow run ends Failed, which no trigger resumes. A person's `hybridrl resume`
starts the count again.
"""

from __future__ import annotations

from typing import Any

from storage.store import RunStore
from tasks.checkpoint import last_committed_update


class CrashLoop(RuntimeError):
    """A run's driver died more often in a row than pipeline.max_driver_restarts allows."""


def count_restart(
    store: RunStore, run_doc: dict[str, Any], limit: int, restarted: bool
) -> dict[str, int]:
    """The run's restart record for run.json: `count` restarts in a row at update `step`.
    Raises CrashLoop when this restart is one more than `limit`."""
    done = last_committed_update(store)
    if not restarted:
        return {"count": 0, "step": done}
    before = run_doc.get("driver_restarts") or {}
    count = before.get("count", 0) + 1 if done <= before.get("step", -1) else 1
    if count > limit:
        times = f"{count} time{'s' if count > 1 else ''}"
        raise CrashLoop(
            f"run {store.run_id}: its driver died {times} in a row without committing an "
            f"update (last: step {done}; pipeline.max_driver_restarts={limit}), so it is not "
            f"restarted again; read the crashed flow runs' logs, then "
            f"`hybridrl resume {store.run_id}`"
        )
    return {"count": count, "step": done}
