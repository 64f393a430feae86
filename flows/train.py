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
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import State, flow, get_run_logger
from prefect.states import Cancelled

from flows.display import step_line
from flows.opening import log_fork, materialize_start, open_run, record_run
from flows.scheduler import RolloutsAhead
from flows.tracking import StepLog
from hybrid_engine.config import HybridConfig, redact
from hybrid_engine.engine import Engine
from hybrid_engine.errors import WorkerLostError
from storage.faults import fault_point
from storage.lease import RunLease
from storage.store import RunStore, check_reach
from storage.tracking.tracker import mark_driver_lost
from tasks.checkpoint import checkpoint, finish, restore
from tasks.driver_cleanup import clean_up_after, driver_record
from tasks.preemption import Preempted, as_preempted, preemption, rearm
from tasks.progress import emit
from tasks.publish import announce, register_final
from tasks.recovery import Recovery
from tasks.restarts import chain_number, count_restart
from tasks.retry import task_options
from tasks.stage_clock import CLOCK
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
    restarted: bool | int = False,
) -> dict[str, Any] | State:
    """Train a policy from a YAML preset + dotted overrides, as run `run_id` (default
    `<preset>-<timestamp>`); or continue run `resume_from` where it stopped (its stored
    config, plus the overrides a resume may change); or fork `fork_from` =
    `PARENT@STEP/STAGE`: a new run `run_id` that takes the parent's stages before that
    point and computes the rest with the overrides (`flows.opening`). With both `config`
    and `resume_from` (a deployment that resumes itself), a run that does not exist yet is
    started; `fork_from` with a `run_id` that is that fork already resumes it.

    A dead or hung worker is recovered from by itself (`tasks.recovery`); SIGTERM ends the
    flow run in state "Preempted" with every committed stage kept. `restarted`: set by the
    trigger that resumes a Crashed flow run, the restarts in a row so far (`tasks.restarts`)."""
    logger = get_run_logger()
    opened = open_run(config, overrides or [], run_id, resume_from, fork_from)
    cfg, store, resume = opened.cfg, opened.store, opened.resume
    name_flow_run(store.run_id)
    lease = RunLease(store, cfg.storage.lease_timeout_s, cfg.storage.request_bound_s)
    wait_s = 2 * cfg.storage.lease_timeout_s if restarted else 0  # the dead driver's lease
    taken = lease.acquire(wait_s, logger.warning)  # LeaseHeld: a live driver trains it
    track = engine = None
    froze = False
    try:  # from here on the lease (and the claim, once taken) is released however it ends
        if taken:
            logger.warning("run %s: its last driver is gone (%s); taking over", store.run_id, taken)
            mark_driver_lost(cfg, store, taken)
        lease.fence(store)  # a driver taken over while it stalled writes nothing more
        recovery = Recovery(cfg, store)
        with preemption():
            # counted before anything that may kill the driver (the model's loading): a new
            # run's restart (its last driver died before run.json) too (CrashLoop)
            doc = (store.read_run() or {}) if resume else {}
            restarts = {
                "driver_restarts": count_restart(
                    store, doc, cfg.pipeline.max_driver_restarts, restarted
                ),
                "driver_chain": chain_number(doc, restarted),
            }
            if resume:  # a SIGKILLed driver of this run may have left its Prefect server
                clean_up_after(doc.get("driver"))
                store.write_run({**doc, "driver": driver_record(), **restarts})
            if opened.lineage:  # a new fork: recorded first (its stages are its parent's)
                record_run(store, cfg, opened.lineage, restarts)
                log_fork(store, opened.lineage)
            if store.lineage is not None:  # new or resumed: its start checkpoint, if due
                materialize_start(store, cfg)
            engine = start_engine(cfg, resume)
            rearm()  # connecting to Ray replaced the SIGTERM handler
            # what start-up made (modules, the engine) lives as long as the run: out of the
            # collector's sight, full collections are cheap and come often enough to free the
            # cyclic garbage of each step (a figure per step) before it piles up (bench/soak.py);
            # only where no caller froze first, and undone when the flow ends
            if froze := not gc.get_freeze_count():
                gc.freeze()
            if not resume and not opened.lineage:  # once the run could start (a bad config
                record_run(store, cfg, extra=restarts)  # leaves nothing)
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
    finally:  # whatever ended the flow, Ctrl-C (KeyboardInterrupt) included
        if froze:  # this run's engine and modules become collectable again
            gc.unfreeze()
        release(lease, engine)
    pool = cfg.ray.pool_name if engine.pool is not None else None
    return result | {
        "run_id": store.run_id,
        "pool": pool,
        "recoveries": recovery.count,
        "mlflow_run_id": track.run_id,
    }


def release(lease: RunLease, engine: Engine | None) -> None:
    """The run's lease and its claim on the pool, when the flow ends."""
    if engine is not None and engine.pool is not None and engine.pool.claim is not None:
        engine.pool.claim.release()
    lease.release()


def run_steps(engine: Engine, store: RunStore, track: StepLog) -> dict[str, Any]:
    """Restore the weights the run needs next, then the steps from there: each task skips
    what its stage has committed (and the update replays committed updates)."""
    start = begin(engine, store)
    opts = task_options(engine.cfg)
    rollout_, reward_, advantage_, update_ = (
        s.with_options(**opts) for s in (rollout, reward, advantage, update)
    )
    with RolloutsAhead(engine, store, rollout_, start) as rollouts:
        steps = Steps(engine, store, track, start, rollouts)
        done = steps.validate_before_training()
        for step in steps:
            rolled = rollouts.rollout(step, after=done)
            scored = reward_(engine, store, step, rolled)
            advantaged = advantage_(engine, store, step, scored)
            done = update_(engine, store, step, advantaged)
            steps.end(step, [rolled, scored, advantaged, done])
    return finish_run(engine, store, track, done) | {"step_wall_s": steps.wall_s}


class Steps:
    """The steps of one pass, and what follows each: the next asynchronous rollouts,
    validation (trainer.test_freq and the last step), the step log, a checkpoint when due
    (trainer.save_freq) with its event, the step's fault point and its console line."""

    def __init__(
        self, engine: Engine, store: RunStore, track: StepLog, start: int, rollouts: Any
    ) -> None:
        self.engine, self.store, self.track, self.rollouts = engine, store, track, rollouts
        self.t, self.start = engine.cfg.trainer, start
        opts = task_options(engine.cfg)
        self.validate, self.checkpoint = (
            validate.with_options(**opts),
            checkpoint.with_options(**opts),
        )
        self.wall_s: dict[int, float] = {}  # the four stages as this pass saw them
        self.began = 0.0

    def __iter__(self) -> Iterator[int]:
        for step in range(self.start, self.t.total_training_steps + 1):
            self.began = time.perf_counter()
            yield step

    def validate_before_training(self) -> Any:
        """Validation 0 (trainer.val_before_train); its result, or None."""
        done = self.validate(self.engine, self.store, 0) if self.t.val_before_train else None
        if done:
            self.track.step(0, done.metrics)
        return done

    def end(self, step: int, results: list[Any]) -> None:
        engine, store, t, done = self.engine, self.store, self.t, results[-1]
        self.rollouts.launch()  # the rollout that uses the weights just made
        self.wall_s[step] = time.perf_counter() - self.began
        metrics = done.metrics
        if step == t.total_training_steps or (t.test_freq and step % t.test_freq == 0):
            metrics = {**metrics, **self.validate(engine, store, step, wait_for=[done]).metrics}
        self.track.step(step, metrics, results)
        if checkpoint_due(store, step, t):  # once the rollouts that use older weights are in
            older = self.rollouts.results(step + 1, step + self.rollouts.k)
            saved = self.checkpoint(
                engine, store, step, t.max_ckpt_to_keep, wait_for=[done, *older]
            )
            self.track.tags({"hybridrl.checkpoint": saved.uri})
            if not saved.skipped:
                announce("hybridrl.checkpoint.committed", store.run_id, step=step, uri=saved.uri)
        fault_point(f"step-{step}:end")
        line = step_line(step, metrics, results)
        get_run_logger().info(line)
        emit("step_finished", step=step, metrics=metrics, line=line)


def begin(engine: Engine, store: RunStore) -> int:
    """Restore the weights the run needs next; the first step to run."""
    t = engine.cfg.trainer
    start, how = restore(engine, store)
    CLOCK.seed(store, start)  # a resumed run's stage time limits, from its stored stages
    if start > t.total_training_steps:
        get_run_logger().info(
            "run %s in %s: %d steps done (%s), trainer.total_training_steps is %d: "
            "nothing to train; a larger trainer.total_training_steps continues it",
            store.run_id,
            store.url,
            start - 1,
            how,
            t.total_training_steps,
        )
    else:
        get_run_logger().info(
            "run %s in %s: starting at step %d (%s)", store.run_id, store.url, start, how
        )
    emit("run_started", run_id=store.run_id, start=start, total=t.total_training_steps)
    return start


def finish_run(engine: Engine, store: RunStore, track: StepLog, done: Any) -> dict[str, Any]:
    """The final policy, its model version, and the event a finished run announces."""
    logger = get_run_logger()
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
        storage_root=redact(store.cfg.root),
        final=redact(result["uri"]),
        tracking_uri=redact(track.tracker.uri) if track.tracker else None,  # no password
        **(registered or {}),
    )
    return result | {"registered": registered}


def checkpoint_due(store: RunStore, step: int, t: Any) -> bool:
    """Every trainer.save_freq steps and at the end; a fork does not save its parent's
    steps again (it inherits the parent's checkpoints)."""
    if store.lineage is not None and step < store.lineage.at.step:
        return False
    return step == t.total_training_steps or bool(t.save_freq and step % t.save_freq == 0)


def start_engine(cfg: HybridConfig, resume: bool) -> Engine:
    """The engine. On the pool, the run first claims it (`PoolBusy` while another run
    trains on it). A pool found broken (left so by an earlier driver) is removed and created
    anew, once; the restore that follows loads the run's last checkpoint into it."""
    fault_point("driver:start-engine")  # a new run has no run.json yet
    claim = None
    if cfg.trainer.backend == "ray":
        from hybrid_engine.pool.sharing import claim_pool

        claim = claim_pool(cfg, say=get_run_logger().warning)
    turn = claim.turn("attach") if claim is not None else contextlib.nullcontext()
    try:
        try:
            with turn:  # a shared pool: its workers build this run's slot in its turn
                engine = Engine(cfg, reset_pool=not resume)
        except WorkerLostError as e:
            if cfg.ray.when_busy == "share":  # other runs' state lives in those workers
                raise
            get_run_logger().warning(
                "pool %r is broken (%s): removing it and starting a new one", cfg.ray.pool_name, e
            )
            from hybrid_engine.pool.pool import down

            down(cfg.ray.pool_name, stop_head=False, keep_claim=True)
            engine = Engine(cfg, reset_pool=not resume)
        if engine.pool is not None:
            engine.pool.hold(claim)
            check_reach(cfg.storage, engine.pool.nodes())
    except BaseException:  # the claim is let go on every way out (Ctrl-C included)
        if claim is not None:
            claim.release()
        raise
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
