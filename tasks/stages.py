"""The four stages of a step as Prefect tasks, plus validation.

Each task: if its stage is committed in storage, return at once; otherwise read its input
(named by the upstream task's result) from storage, call the engine (in-process roles or
the Ray pool), write and commit its output, and return a small result — the stage's URI and
metrics, never tensors. Passing that result on is what draws the edges of Prefect's graph:

    rollout(N)                  -> steps/<N>/rollout     prompts + sampled responses
    reward(N, rollout)          -> steps/<N>/reward      + token-level scores
    advantage(N, reward)        -> steps/<N>/advantage   + log-probs, values, advantages
    update(N, advantage)        -> steps/<N>/update      metrics; weights version N
    validate(N)                 -> steps/<N>/validate    held-out metrics

`update` is the one stage with an effect outside storage (the weights). A committed update
is skipped when the engine holds version N already, and *replayed* from its stored
advantage batch when the engine holds N-1 (after a checkpoint was loaded): the replay
regenerates nothing and recomputes the same weights.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import weakref
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from hybrid_engine.engine import Engine
from hybrid_engine.errors import WorkerLostError
from hybrid_engine.step_metrics import finish_step, peak_rss_gb
from storage.faults import fault_batch, fault_point
from storage.store import RunStore
from tasks.progress import emit
from tasks.stage_clock import CLOCK, stage_limit

# the last update each engine applied to its weights, {step, meta}: a retried commit uses it
APPLIED: weakref.WeakKeyDictionary[Engine, dict[str, Any]] = weakref.WeakKeyDictionary()


class StageOrderError(RuntimeError):
    """A stage's input is not committed, or the weights are at the wrong version."""


def stage_task(fn):  # noqa: ANN001, ANN201 - decorator
    """A stage task: named `step-<N>/<stage>`, no Prefect caching (storage decides), its
    start and end announced to progress listeners (`tasks.progress`), its pool calls under
    the stage's time limit (`tasks.stage_clock`)."""

    signature = inspect.signature(fn)

    @functools.wraps(fn)  # Prefect reads the parameters through __wrapped__
    def announced(*args: Any, **kwargs: Any) -> StageResult:
        a = signature.bind(*args, **kwargs).arguments
        emit("stage_started", step=a["step"], stage=fn.__name__, engine=a["engine"])
        try:  # a hung worker: so declared; a shared pool: the stage's turn
            with stage_limit(a["engine"], a["step"], fn.__name__), turn(a, fn.__name__):
                fault_point(f"step-{a['step']}/{fn.__name__}:start")
                result = fn(*args, **kwargs)
        except WorkerLostError as e:  # where it happened (a rollout may run beside the update)
            e.where = (f"step-{a['step']}/{fn.__name__}", a["step"])
            raise
        upstream = [v for v in a.values() if isinstance(v, StageResult)]
        own_s = result.step_s - (upstream[0].step_s if upstream else 0.0)
        CLOCK.record(fn.__name__, own_s)
        emit(
            "stage_finished",
            step=a["step"],
            stage=fn.__name__,
            seconds=own_s,
            skipped=result.skipped,
        )
        return result

    return task(
        announced,
        name=fn.__name__,
        task_run_name="step-{step}/" + fn.__name__,
        cache_policy=NONE,
        persist_result=False,
    )


def turn(a: dict[str, Any], stage: str) -> contextlib.AbstractContextManager[None]:
    """On a pool shared by several runs (`ray.when_busy=share`), the stage holds the
    workers for its run from start to end: runs interleave at stage boundaries only. The
    reward stage takes none unless it scores on the pool (a reward model): a remote judge
    leaves the workers to the other runs meanwhile (its pool calls take their own turns)."""
    pool = a["engine"].pool
    if pool is None or (stage == "reward" and not a["engine"].cfg.use_reward_model):
        return contextlib.nullcontext()
    return pool.turn(f"step-{a['step']}/{stage}")


def pool_metrics(engine: Engine) -> dict[str, float]:
    """The step's wait for turns and its switches on a shared pool (seconds)."""
    claim = engine.pool.claim if engine.pool is not None else None
    return claim.step_metrics() if hasattr(claim, "step_metrics") else {}


class StageResult:
    """What a stage task returns to the flow: the stage's URI, wall time and metrics.

    A plain class on purpose: Prefect links a task's result to its task run by identity when
    it is passed to another task (the edges of the run graph). It also maps the parts of a
    dict or dataclass result by `id()`, and ids of freed parts get reused by unrelated
    values (spurious edges, see prefect#20558); a plain object is one weak-referenced leaf."""

    def __init__(
        self,
        stage: str,
        step: int,
        uri: str,
        skipped: bool,
        step_s: float,
        metrics: dict[str, float],
    ) -> None:
        self.stage, self.step, self.uri, self.skipped = stage, step, uri, skipped
        self.step_s = step_s  # wall seconds of this step's stages up to and including this one
        self.metrics = metrics
        self.replayed = False  # an update applied again from storage (after a checkpoint load)

    def __repr__(self) -> str:
        return f"StageResult(step-{self.step}/{self.stage}, {self.uri}, skipped={self.skipped})"


def _result(
    stage: str, step: int, uri: str, meta: dict, skipped: bool, upstream: StageResult | None = None
) -> StageResult:
    before = upstream.step_s if upstream is not None else 0.0
    return StageResult(
        stage, step, uri, skipped, before + meta.get("wall_s", 0.0), meta.get("metrics", {})
    )


def _input(store: RunStore, upstream: StageResult) -> Any:
    """The batch an upstream task committed (checked against its sums)."""
    got = store.load_stage(upstream.step, upstream.stage)
    if got is None or got.batch is None:
        raise StageOrderError(
            f"step {upstream.step}: the {upstream.stage} stage ({upstream.uri}) is not "
            "committed or was corrupted since; resume the run to redo it"
        )
    return got.batch


@stage_task
def rollout(engine: Engine, store: RunStore, step: int) -> StageResult:
    """Prompts of step N -> `rollout.n` sampled responses each (the expensive stage)."""
    if done := store.load_stage(step, "rollout"):
        return _result("rollout", step, done.uri, done.meta, True)
    start = time.perf_counter()
    if engine.cfg.algorithm.filter_groups.enabled:
        batch = _dynamic_rollout(engine, store, step)
    elif engine.cfg.rollout.agent.function:  # each episode committed as it ends
        batch = engine.rollout(
            step,
            on_turn=lambda k: fault_point(f"step-{step}/rollout:episode-{k}"),
            episode_log=EpisodeLog(store, step),
        )
    else:  # a multi-turn rollout passes a crash point after each turn
        batch = engine.rollout(step, on_turn=lambda k: fault_point(f"step-{step}/rollout:turn-{k}"))
    meta = {"metrics": batch.meta["metrics"], "weights_version": int(batch["weights_version"][0])}
    if "gen_batches" in batch.meta:  # the prompts this step consumed, and where the next starts
        keys = ("gen_batches", "gen_batch_prompts", "next_gen_batch", "kept_of_prompts")
        meta |= {k: batch.meta[k] for k in keys}
    meta["prompts"] = consumed(
        engine, batch.meta.get("gen_batches", [step]), batch.meta.get("gen_batch_prompts")
    )
    meta["wall_s"] = time.perf_counter() - start
    return _result("rollout", step, store.commit_stage(step, "rollout", batch, meta), meta, False)


class EpisodeLog:
    """Agent episodes of step N's rollout, each committed as it ends
    (`steps/<N>/rollout-episode<i>`): a rollout killed midway runs none of them again."""

    def __init__(self, store: RunStore, step: int) -> None:
        self.store, self.step = store, step

    def load(self, i: int) -> dict[str, Any] | None:
        got = self.store.load_stage(self.step, f"rollout-episode{i}")
        return None if got is None else got.meta["episode"]

    def save(self, i: int, episode: dict[str, Any]) -> None:
        self.store.commit_stage(self.step, f"rollout-episode{i}", None, {"episode": episode})


def consumed(
    engine: Engine, gen_batches: list[int], sizes: list[int] | None = None
) -> list[dict[str, Any]]:
    """The prompts a rollout consumed: per batch of the data order, its epoch and the
    training rows' indices (`PromptData.step_indices`), the first `sizes[i]` of batch i."""
    out = []
    for i, g in enumerate(gen_batches):
        epoch, rows = engine.data.step_indices(g)
        out.append({"batch": g, "epoch": epoch, "rows": rows[: sizes[i]] if sizes else rows})
    return out


def dynamic_start(before: Any) -> tuple[int, list[int] | None]:
    """Where a step's dynamic sampling starts, from the step before's committed rollout
    (None for step 1): its next generation batch, and its (groups kept, prompts used)."""
    if before is None:
        return 1, None
    return before.meta["next_gen_batch"], before.meta.get("kept_of_prompts")


def _dynamic_rollout(engine: Engine, store: RunStore, step: int) -> Any:
    """DAPO dynamic sampling with each round committed on its own (`steps/<N>/rollout-gen<j>`),
    so a crash mid-step regenerates none of them. The step starts after the generation
    batches of the step before, at its kept rate (its committed rollout says)."""
    before = store.load_stage(step - 1, "rollout") if step > 1 else None
    if step > 1 and (before is None or "next_gen_batch" not in before.meta):
        raise StageOrderError(
            f"step {step}: dynamic sampling starts after step {step - 1}'s generation "
            "batches, but its committed rollout does not record them"
        )
    first, prior = dynamic_start(before)

    def load(j: int) -> Any:
        got = store.load_stage(step, f"rollout-gen{j}")
        return None if got is None else got.batch

    def save(j: int, part: Any) -> None:
        store.commit_stage(step, f"rollout-gen{j}", part, {"gen_batch": part.meta["gen_batch"]})

    def on_turn(k: int) -> None:
        fault_point(f"step-{step}/rollout:turn-{k}")

    return engine.sample(step, first, load, save, on_turn, prior)


@stage_task
def reward(engine: Engine, store: RunStore, step: int, rollout: StageResult) -> StageResult:
    """Responses -> token-level scores (rules, a reward model, or a user function)."""
    if done := store.load_stage(step, "reward"):
        return _result("reward", step, done.uri, done.meta, True, rollout)
    start = time.perf_counter()
    batch = engine.reward(_input(store, rollout))
    meta = {"metrics": batch.meta["metrics"], "wall_s": time.perf_counter() - start}
    uri = store.commit_stage(step, "reward", batch, meta)
    return _result("reward", step, uri, meta, False, rollout)


@stage_task
def advantage(engine: Engine, store: RunStore, step: int, reward: StageResult) -> StageResult:
    """Old/ref log-probs, values, KL penalty and the advantage estimator. The adaptive KL
    coefficient it moves is stored with it, so a skipped stage restores it."""
    if done := store.load_stage(step, "advantage"):
        engine.kl_ctrl.value = done.meta["kl_coef"]
        return _result("advantage", step, done.uri, done.meta, True, reward)
    start = time.perf_counter()
    batch = fault_batch(f"step-{step}/advantage:batch", engine.advantage(_input(store, reward)))
    meta = {
        "metrics": batch.meta["metrics"],
        "kl_coef": engine.kl_ctrl.value,
        "wall_s": time.perf_counter() - start,
    }
    uri = store.commit_stage(step, "advantage", batch, meta)
    return _result("advantage", step, uri, meta, False, reward)


@stage_task
def update(engine: Engine, store: RunStore, step: int, advantage: StageResult) -> StageResult:
    """Critic then actor update: weights version N-1 -> N. Its meta holds the whole step's
    metrics (the earlier stages' travel in the batch)."""
    done = store.load_stage(step, "update")
    version = engine.actor.weights_version
    if done and version == step:
        return _result("update", step, done.uri, done.meta, True, advantage)
    applied = APPLIED.get(engine)  # a retry after a failed commit
    if not done and version == step and applied and applied["step"] == step:
        uri = store.commit_stage(step, "update", None, applied["meta"])
        return _result("update", step, uri, applied["meta"], False, advantage)
    if version != step - 1:
        raise StageOrderError(
            f"step {step}: the update needs weights version {step - 1}, the engine holds {version}"
        )
    start = time.perf_counter()
    result = engine.update(_input(store, advantage))
    if done:  # replayed after a checkpoint load: same weights, metrics already stored
        replayed = _result("update", step, done.uri, done.meta, True, advantage)
        replayed.replayed = True
        return replayed
    seconds = time.perf_counter() - start
    metrics = finish_step(result.meta["metrics"], advantage.step_s + seconds) | pool_metrics(engine)
    meta = {"metrics": metrics, "weights_version": engine.actor.weights_version, "wall_s": seconds}
    APPLIED[engine] = {"step": step, "meta": meta}  # the weights are at N: keep the
    uri = store.commit_stage(step, "update", None, meta)  # metrics for a retried commit
    return _result("update", step, uri, meta, False, advantage)


@stage_task
def validate(engine: Engine, store: RunStore, step: int) -> StageResult:
    """Held-out generation and scoring with the weights of version N (step 0 = before training)."""
    if done := store.load_stage(step, "validate"):
        return _result("validate", step, done.uri, done.meta, True)
    if engine.actor.weights_version != step:
        raise StageOrderError(
            f"validation of step {step} needs weights version {step}, the engine holds "
            f"{engine.actor.weights_version}"
        )
    start = time.perf_counter()
    metrics = engine.validate(engine.cfg.tracking.val_samples)
    samples = metrics.pop("_samples", [])
    meta = {
        "metrics": metrics,
        "samples": samples,
        "peak_rss_gb": peak_rss_gb(),
        "wall_s": time.perf_counter() - start,
    }
    uri = store.commit_stage(step, "validate", None, meta)
    return _result("validate", step, uri, meta, False)
