"""Weights checkpoints, restoring a run's weights on resume, and the run's end.

checkpoint(step)   the pool (or the in-process roles) write actor/critic state under
                   checkpoints/step_<N>/; the driver commits it with the files' sha256
restore()          make the engine hold the weights the run needs next; returns the
                   first step to run
finish()           final policy + summary.json under final/
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from hybrid_engine.engine import Engine
from hybrid_engine.files import CorruptObject
from storage.final import FINAL, history, save_final
from storage.store import MARKER, RunStore, storage_options
from tasks.stage_clock import CLOCK
from tasks.stages import StageResult

log = logging.getLogger("hybridrl.resume")


def _roles(engine: Engine) -> dict[str, Any]:
    """The trained roles whose state a checkpoint holds (a reward model is frozen)."""
    roles = {"actor": engine.actor}
    if engine.critic is not None:
        roles["critic"] = engine.critic
    return roles


def _options(engine: Engine, store: RunStore) -> dict[str, Any]:
    # pool workers may not share this process's environment: pass S3 credentials along
    return storage_options(store.cfg, credentials=engine.pool is not None)


@task(
    name="checkpoint",
    task_run_name="step-{step}/checkpoint",
    cache_policy=NONE,
    persist_result=False,
)
def checkpoint(engine: Engine, store: RunStore, step: int, keep: int) -> StageResult:
    """Save weights version N (+ optimizer, scheduler, RNG, KL coefficient), commit, prune."""
    CLOCK.where = f"step-{step}/checkpoint"
    d = store.checkpoint_dir(step)
    if store.marker(d) is not None:
        return StageResult("checkpoint", step, store.uri(d), True, 0.0, {})
    if engine.actor.weights_version != step:
        raise RuntimeError(
            f"checkpoint of step {step}: the engine holds weights version "
            f"{engine.actor.weights_version}"
        )
    if missing := rollouts_missing(store, step, engine.cfg.trainer, verify=False):
        raise RuntimeError(
            f"checkpoint of step {step}: the rollouts of steps {missing} use weights older "
            "than it holds and must be committed first (trainer.max_staleness)"
        )
    uri = save_checkpoint(engine, store, step)
    store.prune_checkpoints(keep)
    return StageResult("checkpoint", step, uri, False, 0.0, {})


def save_checkpoint(engine: Engine, store: RunStore, step: int) -> str:
    """The trained roles' state and the KL coefficient as checkpoint step_N, committed."""
    d = store.checkpoint_dir(step)
    files: dict[str, str] = {}
    store.check_lease()  # the workers write these files themselves, not through the store
    for name, role in _roles(engine).items():
        saved = role.save(store.uri(f"{d}/{name}"), _options(engine, store))
        files |= {f"{name}/{f}": sha for f, sha in saved.items()}
    meta = {"step": step, "weights_version": step, "kl_coef": engine.kl_ctrl.value}
    return store.commit_checkpoint(step, files, meta)


def last_committed_update(store: RunStore) -> int:
    """The last step whose update is committed (0 = none); latest.json is the hint."""
    latest = store.read_latest() or {}
    step = int(latest.get("step") or 0)
    while step > 0 and not store.is_committed(step, "update"):
        step -= 1
    while store.is_committed(step + 1, "update"):  # latest.json may lag one commit
        step += 1
    return step


def rollouts_missing(store: RunStore, version: int, t: Any, verify: bool = True) -> list[int]:
    """Asynchronous training: the rollouts of steps version+1 .. version+k use weights older
    than `version`; a run can go on from `version` only if they are committed (with `verify`,
    their objects read back against their sums; without, the markers alone). The steps of
    those that are not (none with trainer.max_staleness = 0)."""
    if version == 0:  # the first rollouts use version 0 itself
        return []
    last = min(version + t.max_staleness, t.total_training_steps)
    ok = (
        (lambda s: store.load_stage(s, "rollout") is not None)
        if verify
        else (lambda s: store.is_committed(s, "rollout"))
    )
    return [s for s in range(version + 1, last + 1) if not ok(s)]


def load_checkpoint(engine: Engine, store: RunStore, step: int) -> bool:
    """Load checkpoint step_N (a fork's may be its parent's) into the trained roles and the
    KL controller; False when it is not committed or a file fails its sha256 (warned)."""
    got = store.checkpoint_files(step)
    if got is None:
        return False
    files, meta = got
    d = store.checkpoint_dir(step)
    try:
        for name, role in _roles(engine).items():
            mine = {f.split("/", 1)[1]: sha for f, sha in files.items() if f.startswith(f"{name}/")}
            role.load(store.locate(d).uri(f"{d}/{name}"), _options(engine, store), mine)
    except CorruptObject as e:
        log.warning("checkpoint step_%d is unusable (%s)", step, e)
        return False
    engine.kl_ctrl.value = meta["kl_coef"]
    return True


def restore(engine: Engine, store: RunStore) -> tuple[int, str]:
    """Make the engine hold the weights of the last committed update U; return the first
    step to run and what was done. A warm pool that holds U of this run (or, for a fork, of
    an ancestor before the fork point) is kept as is;
    otherwise the newest readable checkpoint C <= U is loaded (the flow then replays the
    updates C+1..U from their stored batches), or, without one, fresh weights are taken.
    Asynchronous training goes on from a version V only if the rollouts that use older
    weights than V are committed (`rollouts_missing`): otherwise an older checkpoint."""
    CLOCK.where = "restore"
    engine.forget_rollout_weights()
    done = last_committed_update(store)
    t = engine.cfg.trainer
    version, owner = engine.actor.weights_version, engine.actor.weights_run
    if version == done and (
        done == 0
        or owner == store.run_id
        or (store.lineage is not None and store.lineage.same_weights(owner, version))
    ):
        if not (missing := rollouts_missing(store, done, t)):
            return max(done, 1), f"the engine holds weights version {done}: nothing to load"
        log.info(
            "the engine holds version %d, but the rollouts of steps %s need older "
            "weights: loading a checkpoint",
            done,
            missing,
        )
    for step in reversed([c for c in store.checkpoints() if c <= done]):
        if missing := rollouts_missing(store, step, t):
            log.info(
                "checkpoint step_%d: the rollouts of steps %s are not committed and need "
                "older weights; trying an older one",
                step,
                missing,
            )
            continue
        if not load_checkpoint(engine, store, step):
            continue
        return step + 1, (
            f"loaded checkpoint step_{step} (the engine held version {version}); "
            f"replaying {done - step} committed update(s) from storage"
        )
    if version != 0 or owner is not None:
        engine.reset_weights()
    return 1, f"no usable checkpoint: fresh weights, replaying {done} committed update(s)"


@task(name="finish", task_run_name="final", cache_policy=NONE, persist_result=False)
def finish(engine: Engine, store: RunStore) -> dict[str, Any]:
    """The trained policy and summary.json under final/ (skipped when committed for as many
    steps or more; a finished run trained further gets its new final policy: the old marker
    goes first, so a crash in between leaves final/ uncommitted, never stale)."""
    CLOCK.where = "final"
    rows = history(store, engine.cfg.trainer.total_training_steps)
    done = store.marker(FINAL)
    steps = len([h for h in rows if h.get("step", 0) > 0])
    if done is not None and done.get("steps", 0) < steps:
        log.info(
            "final/ holds the policy after %s steps; writing the one after %d",
            done.get("steps"),
            steps,
        )
        store.remove(f"{FINAL}/{MARKER}")
        done = None
    if done is None:
        model, adapter_state = engine.export()
        save_final(store, model, engine.tokenizer, engine.cfg, rows, adapter_state)
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    last = rows[-1] if rows else {}
    return {"uri": store.uri(FINAL), "steps": len(rows), "last": last, "validation": val}
