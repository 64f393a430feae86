"""The four stages of a step as Prefect tasks, plus validation.

Each task: if its stage is committed in storage, return at once; otherwise read its input
from storage, call the engine (in-process roles or the Ray pool), write and commit its
output, and return a small result — URIs and metrics, never tensors:

    rollout(step)    -> steps/<N>/rollout     prompts + sampled responses
    reward(step)     <- rollout               -> steps/<N>/reward     + token-level scores
    advantage(step)  <- reward                -> steps/<N>/advantage  + log-probs, values, advantages
    update(step)     <- advantage             -> steps/<N>/update     metrics; weights version N
    validate(step)                            -> steps/<N>/validate   held-out metrics

`update` is the one stage with an effect outside storage (the weights). A committed update
is skipped when the engine holds version N already, and *replayed* from its stored
advantage batch when the engine holds N-1 (after a checkpoint was loaded): the replay
regenerates nothing and recomputes the same weights.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from hybrid_engine.trainer import Engine, finish_step, peak_rss_gb
from storage.store import RunStore


class StageOrderError(RuntimeError):
    """A stage's input is not committed, or the weights are at the wrong version."""


def stage_task(fn):  # noqa: ANN001, ANN201 - decorator
    """A stage task: named `step-<N>/<stage>`, no Prefect caching (storage decides)."""
    return task(
        fn,
        name=fn.__name__,
        task_run_name="step-{step}/" + fn.__name__,
        cache_policy=NONE,
        persist_result=False,
    )


def _result(stage: str, step: int, uri: str, meta: dict, skipped: bool) -> dict[str, Any]:
    return {"stage": stage, "step": step, "uri": uri, "skipped": skipped,
            "wall_s": meta.get("wall_s", 0.0), "metrics": meta.get("metrics", {})}  # fmt: skip


def _input(store: RunStore, step: int, stage: str) -> Any:
    got = store.load_stage(step, stage)
    if got is None or got.batch is None:
        raise StageOrderError(f"step {step}: the {stage} stage is not committed (or corrupted)")
    return got.batch


@stage_task
def rollout(engine: Engine, store: RunStore, step: int) -> dict[str, Any]:
    """Prompts of step N -> `rollout.n` sampled responses each (the expensive stage)."""
    if done := store.load_stage(step, "rollout"):
        return _result("rollout", step, done.uri, done.meta, True)
    start = time.perf_counter()
    batch = engine.rollout(step)
    meta = {"metrics": batch.meta["metrics"], "weights_version": engine.actor.weights_version}
    meta["wall_s"] = time.perf_counter() - start
    return _result("rollout", step, store.commit_stage(step, "rollout", batch, meta), meta, False)


@stage_task
def reward(engine: Engine, store: RunStore, step: int) -> dict[str, Any]:
    """Responses -> token-level scores (rules, a reward model, or a user function)."""
    if done := store.load_stage(step, "reward"):
        return _result("reward", step, done.uri, done.meta, True)
    start = time.perf_counter()
    batch = engine.reward(_input(store, step, "rollout"))
    meta = {"metrics": batch.meta["metrics"], "wall_s": time.perf_counter() - start}
    return _result("reward", step, store.commit_stage(step, "reward", batch, meta), meta, False)


@stage_task
def advantage(engine: Engine, store: RunStore, step: int) -> dict[str, Any]:
    """Old/ref log-probs, values, KL penalty and the advantage estimator. The adaptive KL
    coefficient it moves is stored with it, so a skipped stage restores it."""
    if done := store.load_stage(step, "advantage"):
        engine.kl_ctrl.value = done.meta["kl_coef"]
        return _result("advantage", step, done.uri, done.meta, True)
    start = time.perf_counter()
    batch = engine.advantage(_input(store, step, "reward"))
    meta = {"metrics": batch.meta["metrics"], "kl_coef": engine.kl_ctrl.value,
            "wall_s": time.perf_counter() - start}  # fmt: skip
    uri = store.commit_stage(step, "advantage", batch, meta)
    return _result("advantage", step, uri, meta, False)


@stage_task
def update(engine: Engine, store: RunStore, step: int, before_s: float = 0.0) -> dict[str, Any]:
    """Critic then actor update: weights version N-1 -> N. Its meta holds the whole step's
    metrics (the earlier stages' travel in the batch); `before_s` is their wall time."""
    done = store.load_stage(step, "update")
    version = engine.actor.weights_version
    if done and version == step:
        return _result("update", step, done.uri, done.meta, True)
    if version != step - 1:
        raise StageOrderError(
            f"step {step}: the update needs weights version {step - 1}, the engine holds {version}"
        )
    start = time.perf_counter()
    result = engine.update(_input(store, step, "advantage"))
    if done:  # replayed after a checkpoint load: same weights, metrics already stored
        return _result("update", step, done.uri, {**done.meta, "replayed": True}, True)
    seconds = time.perf_counter() - start
    metrics = finish_step(result.meta["metrics"], before_s + seconds)
    meta = {"metrics": metrics, "weights_version": engine.actor.weights_version, "wall_s": seconds}
    return _result("update", step, store.commit_stage(step, "update", None, meta), meta, False)


@stage_task
def validate(engine: Engine, store: RunStore, step: int) -> dict[str, Any]:
    """Held-out generation and scoring with the weights of version N (step 0 = before training)."""
    if done := store.load_stage(step, "validate"):
        return _result("validate", step, done.uri, done.meta, True)
    if engine.actor.weights_version != step:
        raise StageOrderError(
            f"validation of step {step} needs weights version {step}, the engine holds "
            f"{engine.actor.weights_version}"
        )
    metrics = engine.validate()
    meta = {"metrics": metrics, "peak_rss_gb": peak_rss_gb()}
    uri = store.commit_stage(step, "validate", None, meta)
    return _result("validate", step, uri, meta, False)
