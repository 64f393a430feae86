"""The `train` flow: a training run as a Prefect flow, four checkpointed tasks per step.

    restore            the engine holds the weights the run needs next
    validate(0)        before training (trainer.val_before_train)
    for each step N:
        rollout(N) -> reward(N) -> advantage(N) -> update(N)
        validate(N)    every trainer.test_freq steps and at the end
        checkpoint(N)  every trainer.save_freq steps and at the end
    finish             final policy + summary.json

With trainer.max_staleness = k > 0 (asynchronous training) the rollout of step N+k+1 is
submitted as soon as update(N) made the weights it uses, and runs beside the next k steps'
reward, advantage and update (`RolloutsAhead`); step N+k+1 takes its result when it starts.

Every task skips work its stage has committed, so the same flow both starts a run and
resumes one (`resume_from=<run_id>`), wherever the previous flow run stopped. The same
property heals a run in place: a worker that dies or hangs ends the pass, the pool is
re-created and the steps run again from `restore` (`tasks.recovery`).
Parameters are plain JSON values (a deployment can pass them).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import subprocess
import time
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from prefect import State, flow, get_run_logger
from prefect.states import Cancelled

from flows.opening import open_run
from hybrid_engine.config import HybridConfig, redact
from hybrid_engine.engine import Engine
from hybrid_engine.pool.group import CallsAbandoned, WorkerLostError
from hybrid_engine.staleness import rollout_version
from storage.faults import fault_point
from storage.final import history
from storage.store import RunStore, check_reach
from storage.tracking import Tracker
from tasks.checkpoint import checkpoint, finish, restore
from tasks.progress import emit
from tasks.recovery import (
    CLOCK,
    Preempted,
    Recovery,
    as_preempted,
    clean_up_after,
    driver_record,
    preemption,
    rearm,
)
from tasks.registry import announce, register_final
from tasks.stages import advantage, reward, rollout, update, validate


def flow_run_name() -> str:
    """The run id (a deployment run without one is named after its preset until it starts)."""
    from prefect.runtime import flow_run

    p = flow_run.parameters
    if name := p.get("resume_from") or p.get("run_id"):
        return name
    if fork := p.get("fork_from"):
        return f"{fork.partition('@')[0]}-fork"
    return f"{Path(p.get('config') or 'run').stem}-new"


@flow(name="train", flow_run_name=flow_run_name, log_prints=True)
def train(
    config: str | None = None,
    overrides: list[str] | None = None,
    run_id: str | None = None,
    resume_from: str | None = None,
    fork_from: str | None = None,
) -> dict[str, Any] | State:
    """Train a policy from a YAML preset + dotted overrides, as run `run_id` (default
    `<preset>-<timestamp>`); or continue run `resume_from` where it stopped (its stored
    config, plus the overrides a resume may change); or fork `fork_from` =
    `PARENT@STEP/STAGE`: a new run `run_id` that takes the parent's stages before that
    point and computes the rest with the overrides (`flows.opening`). With both `config`
    and `resume_from` (a deployment that resumes itself), a run that does not exist yet is
    started; `fork_from` with a `run_id` that is that fork already resumes it.

    A dead or hung worker is recovered from by itself (`tasks.recovery`); SIGTERM ends the
    flow run in state "Preempted" with every committed stage kept."""
    logger = get_run_logger()
    opened = open_run(config, overrides or [], run_id, resume_from, fork_from)
    cfg, store, resume = opened.cfg, opened.store, opened.resume
    name_flow_run(store.run_id)
    if resume:  # a SIGKILLed driver of this run may have left its Prefect server running
        doc = store.read_run() or {}
        clean_up_after(doc.get("driver"))
        store.write_run({**doc, "driver": driver_record()})
    recovery = Recovery(cfg, store)
    track = None
    try:
        with preemption():
            if opened.lineage:  # a new fork: recorded first (its stages are its parent's)
                record_run(store, cfg, opened.lineage)
                log_fork(store, opened.lineage)
            if store.lineage is not None:  # new or resumed: its start checkpoint, if due
                materialize_start(store, cfg)
            engine = start_engine(cfg, resume)
            rearm()  # connecting to Ray replaced the SIGTERM handler
            if not resume and not opened.lineage:  # once the run could start (a bad config
                record_run(store, cfg)  # leaves nothing)
            track = StepLog(cfg, store)
            with track:
                while True:  # each pass: restore the weights, run what is not committed
                    try:
                        result = run_steps(engine, store, track)
                        break
                    except WorkerLostError as e:
                        track.recovered(recovery.handle(e, engine), recovery.count)
                        rearm()
    except (Preempted, Exception) as error:
        if (e := as_preempted(error)) is None:
            raise
        if cancelling():  # the SIGTERM was Prefect carrying out a cancellation
            return Cancelled(message=f"cancelled at {e}; `hybridrl resume {store.run_id}`")
        line = (
            f"preempted ({e}): every committed stage is kept, nothing is half-written; "
            f"continue with `hybridrl resume {store.run_id}`"
        )
        logger.warning(line)
        return Cancelled(name="Preempted", message=line)
    pool = cfg.ray.pool_name if engine.pool is not None else None
    return result | {
        "run_id": store.run_id,
        "pool": pool,
        "recoveries": recovery.count,
        "mlflow_run_id": track.run_id,
    }


def run_steps(engine: Engine, store: RunStore, track: StepLog) -> dict[str, Any]:
    """Restore the weights the run needs next, then the steps from there: each task skips
    what its stage has committed (and the update replays committed updates)."""
    logger = get_run_logger()
    t = engine.cfg.trainer
    start, how = restore(engine, store)
    CLOCK.seed(store, start)  # a resumed run's stage time limits, from its stored stages
    if start > t.total_training_steps:
        logger.info(
            "run %s in %s: %d steps done (%s), trainer.total_training_steps is %d: "
            "nothing to train; a larger trainer.total_training_steps continues it",
            store.run_id,
            store.url,
            start - 1,
            how,
            t.total_training_steps,
        )
    else:
        logger.info("run %s in %s: starting at step %d (%s)", store.run_id, store.url, start, how)
    emit("run_started", run_id=store.run_id, start=start, total=t.total_training_steps)
    opts = task_options(engine.cfg)
    rollout_, reward_, advantage_, update_ = (
        s.with_options(**opts) for s in (rollout, reward, advantage, update)
    )
    validate_, checkpoint_ = validate.with_options(**opts), checkpoint.with_options(**opts)

    ahead = RolloutsAhead(engine, store, rollout_, start)
    ahead.launch()  # asynchronous: the rollouts the weights held now are for
    done = validate_(engine, store, 0) if t.val_before_train else None
    if done:
        track.step(0, done.metrics)
    step_wall_s = {}  # the four stages as this flow run saw them (bench/overhead.py)
    with ahead:
        for step in range(start, t.total_training_steps + 1):
            began = time.perf_counter()
            if ahead.k:
                rolled = ahead.take(step)
            else:
                ahead.publish_for(step)  # a separate rollout group (colocated: nothing)
                rolled = rollout_(engine, store, step, wait_for=[done] if done else None)
            scored = reward_(engine, store, step, rolled)
            advantaged = advantage_(engine, store, step, scored)
            done = update_(engine, store, step, advantaged)
            ahead.launch()  # the rollout that uses the weights just made
            step_wall_s[step] = time.perf_counter() - began
            metrics = done.metrics
            last = step == t.total_training_steps
            if last or (t.test_freq and step % t.test_freq == 0):
                metrics = {**metrics, **validate_(engine, store, step, wait_for=[done]).metrics}
            track.step(step, metrics, [rolled, scored, advantaged, done])
            if checkpoint_due(store, step, t):  # once the rollouts that
                older = ahead.results(step + 1, step + ahead.k)  # use older weights are in
                saved = checkpoint_(
                    engine, store, step, t.max_ckpt_to_keep, wait_for=[done, *older]
                )
                track.tags({"hybridrl.checkpoint": saved.uri})
                if not saved.skipped:
                    announce(
                        "hybridrl.checkpoint.committed", store.run_id, step=step, uri=saved.uri
                    )
            fault_point(f"step-{step}:end")
            line = step_line(step, metrics, [rolled, scored, advantaged, done])
            logger.info(line)
            emit("step_finished", step=step, metrics=metrics, line=line)
    result = finish(engine, store, wait_for=[done] if done else None)
    track.tags({"hybridrl.final": result["uri"]})
    try:  # the final policy as a model version; the run is done whatever happens here
        registered = register_final(engine.cfg, store)
    except Exception as e:
        logger.warning(
            "the final policy was not registered (%s: %s); `hybridrl register %s` does it later",
            type(e).__name__,
            e,
            store.run_id,
        )
        registered = None
    if registered:
        track.tags({"hybridrl.model_version": registered["model"]})
        logger.info("final policy registered as %s", registered["model"])
    announce(
        "hybridrl.run.finished",
        store.run_id,
        {"hybridrl.registered": str(bool(registered)).lower()},
        run_id=store.run_id,
        storage_root=store.cfg.root,
        final=result["uri"],
        tracking_uri=track.tracker.uri if track.tracker else None,
        **(registered or {}),
    )
    return result | {"step_wall_s": step_wall_s, "registered": registered}


class RolloutsAhead:
    """Asynchronous training (trainer.max_staleness = k > 0): the rollout of step M uses
    weights version M-1-k (`hybrid_engine.staleness`), so it is submitted to run in the
    background as soon as the trainer holds that version, each after the one before (the
    rollout group generates one at a time). With k = 0 it does nothing."""

    def __init__(self, engine: Engine, store: RunStore, task: Any, first: int) -> None:
        self.engine, self.store, self.task, self.next = engine, store, task, first
        self.k = engine.cfg.trainer.max_staleness
        self.total = engine.cfg.trainer.total_training_steps
        self.futures: dict[int, Any] = {}

    def launch(self) -> None:
        """Submit the rollouts whose weights the trainer holds now (or older: those are
        committed, `tasks.checkpoint.rollouts_missing`)."""
        if not self.k:
            return
        version = self.engine.actor.weights_version
        while self.next <= min(version + 1 + self.k, self.total):
            m = self.next
            if rollout_version(m, self.k) == version:
                self.publish_for(m)
            before = self.futures.get(m - 1)
            self.futures[m] = self.task.submit(
                self.engine, self.store, m, wait_for=[before] if before else None
            )
            self.next += 1

    def publish_for(self, step: int) -> None:
        """The trainer's weights for step N's rollout, unless it is committed already."""
        if not self.store.is_committed(step, "rollout"):
            self.engine.publish_weights()

    def take(self, step: int) -> Any:
        """Step N's rollout, once committed; its error (a dead worker) is raised here."""
        return self.futures.pop(step).result()

    def results(self, first: int, last: int) -> list[Any]:
        """The rollouts of steps first..last that were submitted, once committed."""
        return [self.futures[m].result() for m in range(first, last + 1) if m in self.futures]

    def __enter__(self) -> RolloutsAhead:
        return self

    def __exit__(self, *exc: Any) -> None:
        """However the steps ended, no rollout is left running (a recovery re-creates the
        pool next; a preempted driver's rollouts give up at once, `pool.STOPPING`)."""
        for future in self.futures.values():
            with contextlib.suppress(Exception, CallsAbandoned):  # the steps' error goes on
                future.wait()
        self.futures.clear()


def checkpoint_due(store: RunStore, step: int, t: Any) -> bool:
    """Every trainer.save_freq steps and at the end; a fork does not save its parent's
    steps again (it inherits the parent's checkpoints)."""
    if store.lineage is not None and step < store.lineage.at.step:
        return False
    return step == t.total_training_steps or bool(t.save_freq and step % t.save_freq == 0)


def record_run(store: RunStore, cfg: HybridConfig, lineage: dict[str, Any] | None = None) -> None:
    """run.json of a new run (a fork's with its lineage)."""
    store.write_run(
        {
            "run_id": store.run_id,
            "config": redact(cfg.model_dump(mode="json")),
            "code_version": code_version(),
            "created_at": time.time(),
            "driver": driver_record(),
        }
        | ({"lineage": lineage} if lineage else {})
    )


def log_fork(store: RunStore, lineage: dict[str, Any]) -> None:
    """What a new fork takes from its parent and what it changes."""
    changes = ", ".join(f"{k}={v}" for k, v in lineage["overrides"].items()) or "no overrides"
    get_run_logger().info(
        "run %s: a fork of %s at %s, referencing %d steps and %d checkpoints of it (%s)",
        store.run_id,
        lineage["parent"],
        lineage["at"],
        len(lineage["steps"]),
        len(lineage["checkpoints"]),
        changes,
    )


def materialize_start(store: RunStore, cfg: HybridConfig) -> None:
    """A fork that changes what updates read and inherits no checkpoint at its start gets
    that checkpoint made first, with its parent's config (`tasks.replay.materialize`);
    again on a resume if a kill came first (nothing to do once it has any checkpoint of
    its own at or past that version)."""
    version = store.lineage.doc.get("materialize")
    if version is None or any(c >= version for c in store.checkpoints(own=True)):
        return
    from flows.opening import parent_config
    from tasks.replay import materialize

    began = time.perf_counter()
    materialize(Engine(parent_config(store, cfg)), store, version)
    get_run_logger().info(
        "run %s: weights version %d of %s made with its config and saved as "
        "the fork's checkpoint step_%d (%.1f s)",
        store.run_id,
        version,
        store.lineage.parent.run_id,
        version,
        time.perf_counter() - began,
    )


def start_engine(cfg: HybridConfig, resume: bool) -> Engine:
    """The engine. A pool found broken (left so by an earlier driver) is removed and created
    anew, once; the restore that follows loads the run's last checkpoint into it."""
    try:
        engine = Engine(cfg, reset_pool=not resume)
    except WorkerLostError as e:
        get_run_logger().warning(
            "pool %r is broken (%s): removing it and starting a new one", cfg.ray.pool_name, e
        )
        from hybrid_engine.pool.pool import down

        down(cfg.ray.pool_name, stop_head=False)
        engine = Engine(cfg, reset_pool=not resume)
    if engine.pool is not None:
        check_reach(cfg.storage, engine.pool.nodes())
    return engine


def name_flow_run(run_id: str) -> None:
    """The flow run is named after the run id (a deployment run started without one gets
    it here): a deployment trigger resumes a preempted run by this name."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if flow_run.id and flow_run.name != run_id:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=run_id)


def cancelling() -> bool:
    """Whether this flow run is being cancelled (Prefect's runner sends SIGTERM for that
    too): a cancellation must not look like a preemption, or a trigger would resume it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run.id).state
    return state is not None and state.type == StateType.CANCELLING


# ----------------------------------------------------------------------------- helpers
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


def task_options(cfg: HybridConfig) -> dict[str, Any]:
    """Retries with exponential backoff, for transient failures only."""
    p = cfg.pipeline
    return {
        "retries": p.retries,
        "retry_delay_seconds": [p.retry_delay_s * 2**i for i in range(p.retries)] or 0,
        "retry_condition_fn": retry_if_transient,
    }


NOT_TRANSIENT = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
)


STORAGE_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def is_transient(e: BaseException) -> bool:
    """Worth retrying: I/O and network errors (S3, a connection reset, a timeout); not a
    full or read-only disk."""
    if isinstance(e, NOT_TRANSIENT) or getattr(e, "errno", None) in STORAGE_FULL:
        return False
    if isinstance(e, OSError):  # ConnectionError, TimeoutError, socket errors
        return True
    return type(e).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp")


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    error = state.result(raise_on_failure=False)
    retry = isinstance(error, BaseException) and is_transient(error)
    if not retry:
        logging.getLogger("hybridrl").error("%s failed for good: %r", task_run.name, error)
    return retry


def code_version() -> str:
    """The package version, plus the git commit when run from a checkout."""
    v = package_version("hybridrl")
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{v}+{sha}" if sha else v


def _fmt(m: dict[str, Any], key: str, spec: str = ".3f") -> str:
    return format(m[key], spec) if key in m else "-"


def step_line(step: int, m: dict[str, Any], results: list[Any]) -> str:
    skipped = [f"{r.stage} (replayed)" if r.replayed else r.stage for r in results if r.skipped]
    return (
        f"step {step:>4}  score {_fmt(m, 'critic/score/mean')}  "
        f"val_acc {_fmt(m, 'val/accuracy')}  pg_loss {_fmt(m, 'actor/pg_loss', '+.4f')}  "
        f"entropy {_fmt(m, 'actor/entropy')}  len {_fmt(m, 'response_length/mean', '.1f')}  "
        f"gen {_fmt(m, 'perf/tokens_per_s_rollout', '.0f')} tok/s  "
        f"{_fmt(m, 'timing_s/step', '.1f')} s"
        + (f"  (from storage: {', '.join(skipped)})" if skipped else "")
    )
