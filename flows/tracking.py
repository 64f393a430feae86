"""A flow's step log over its MLflow run (`tracking.enabled`): each step's metrics exactly once
(a resumed flow skips the steps MLflow has), the stage timeline, samples and curves at a
validation, recoveries, and the run's end state."""

from __future__ import annotations

from typing import Any

from flows.opening import code_version
from hybrid_engine.config import HybridConfig
from storage.final import history
from storage.store import RunStore
from storage.tracking.tracker import Tracker
from tasks.preemption import as_preempted

SAMPLE_METRICS = ("critic/score/", "critic/rewards/", "response_length/", "rollout_corr/")


class StepLog:
    """MLflow for the flow (`tracking.enabled`): each step's metrics exactly once, the run
    marked FINISHED at the end, KILLED when preempted and FAILED when the flow raises (a
    SIGKILLed driver leaves it RUNNING until the resume finishes it)."""

    def __init__(self, cfg: HybridConfig, store: RunStore) -> None:
        from prefect.runtime import flow_run

        self.store = store
        self.rows: list[dict[str, Any]] | None = None  # per-step metrics for the curves
        self.tracker = None
        self.run_id: str | None = None
        self.logged: set[int] = set()
        if cfg.tracking.enabled:
            self.tracker = Tracker.open(cfg, store, flow_run.id, code_version())
            self.run_id = self.tracker.run_id
            self.logged = self.tracker.logged_steps()
            if store.lineage is not None:  # a fork logs its own steps; the parent has the rest
                self.logged |= set(range(store.lineage.at.step))

    def step(self, step: int, metrics: dict[str, Any], stages: list[Any] = ()) -> None:
        """A step's metrics, its stage timeline, and at a validation the generations and
        curves so far -- unless MLflow has this step already."""
        if self.tracker is None:
            return
        if self.rows is not None and self.rows[-1]["step"] < step:
            self.rows.append({"step": step, **metrics})
        if step in self.logged:
            return
        if stages:  # wall seconds per stage, from the cumulative `step_s` of each result
            ends = [s.step_s for s in stages]
            starts = [0.0, *ends[:-1]]
            walls = [(s.stage, e - b) for s, e, b in zip(stages, ends, starts, strict=True)]
            self.tracker.log_timeline(step, walls, metrics)
        if "val/accuracy" in metrics and (val := self.store.load_stage(step, "validate")):
            self.tracker.log_samples(step, val.meta.get("samples", []))
            if self.rows is None:  # read from storage once, then kept up as steps go
                self.rows = history(self.store, step)
            self.tracker.log_curves(self.rows)
        self.tracker.log_step(step, metrics)
        if "async/weights_version" in metrics:  # the samples' curves by the weights that made
            version = int(metrics["async/weights_version"])  # them: no shift under asynchrony
            self.tracker.log_step(
                version,
                {f"by_version/{k}": v for k, v in metrics.items() if k.startswith(SAMPLE_METRICS)},
            )
        self.logged.add(step)

    def tags(self, tags: dict[str, str]) -> None:
        if self.tracker is not None:
            self.tracker.set_tags(tags)

    def recovered(self, event: dict[str, Any], count: int) -> None:
        """A recovery: tag `hybridrl.recoveries` and metric `recoveries` at its step."""
        if self.tracker is not None:
            self.tracker.set_tags(
                {
                    "hybridrl.recoveries": str(count),
                    "hybridrl.last_recovery": f"{event['where']}: {event['worker']} {event['how']}",
                }
            )
            self.tracker.log_metric("recoveries", count, event["step"])

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, _: Any) -> None:
        if self.tracker is not None:
            status = "FINISHED" if kind is None else "FAILED"
            if kind is not None and as_preempted(error) is not None:
                status = "KILLED"
            self.tracker.finish(status)
