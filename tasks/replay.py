"""Replaying committed stages: recompute a stage from its stored input and the weights it
saw, and compare the result with what is stored (an audit of the run's reproducibility).

    stage        its input                         the weights it saw
    rollout N    step N's prompts (+ DAPO cursor)  version N-1-k (k = trainer.max_staleness)
    reward N     rollout N's batch                 none (a reward model is frozen)
    advantage N  reward N's batch, KL coefficient  version N-1 (old log-probs, values), ref
    update N     advantage N's batch               version N-1 with its optimizer state
    validate N   the held-out rows                 version N

Weights version V comes from the newest committed checkpoint C <= V plus the stored updates
C+1..V applied again (as a resume does). The comparison is exact: every tensor and
per-sample value bit for bit, and every metric but wall times and speeds (`timing_s/*`,
`perf/*`); an update is also compared, where a checkpoint of its step exists, with the
weights stored there. `audit_run` walks a whole run on a fresh engine in the order the
weights were made, each stage from its stored input: a stage that does not reproduce is
reported where it is, and the later stages still get the inputs the run had. (The weights
follow the stored advantage batches: a stored batch altered after the fact shows as its own
stage and as every later stage that used the weights it changed.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_engine import STAGES
from hybrid_engine.batch import Batch
from hybrid_engine.engine import Engine
from hybrid_engine.staleness import rollout_version
from storage.store import RunStore
from tasks.checkpoint import last_committed_update, load_checkpoint, save_checkpoint
from tasks.stages import dynamic_start

STAGE_ORDER = (*STAGES, "validate")
VOLATILE = ("timing_s/", "perf/", "_")  # wall times, speeds, memory: not part of the result


@dataclass
class Audit:
    """One replayed stage: `equal` None when there was nothing stored to compare with."""

    step: int
    stage: str
    equal: bool | None
    detail: str
    seconds: float


def first_difference(stored: Batch, got: Batch) -> str | None:
    """The first field (sorted by name) where two batches differ, with the largest absolute
    difference for a tensor; None when they are bit-equal."""
    got = Batch.from_bytes(*got.to_bytes())  # as storage holds it (dtypes, lists)
    for key in sorted(set(stored.keys()) | set(got.keys())):
        if key not in stored or key not in got:
            return f"{key}: only in the {'replayed' if key in got else 'stored'} batch"
        a, b = stored[key], got[key]
        if isinstance(a, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                return f"{key}: stored {a.dtype}{list(a.shape)}, replayed {b.dtype}{list(b.shape)}"
            if not torch.equal(a, b):
                if not a.is_floating_point():  # token ids, masks: how many, not how far
                    return f"{key}: {int((a != b).sum())} of {a.numel()} values differ"
                diff = (a.double() - b.double()).abs().nan_to_num(math.inf).max().item()
                return f"{key}: max |difference| {diff:.3g}"
        elif a != b:
            row = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            return f"{key}: differs first at sample {row}"
    return None


def metric_difference(stored: dict[str, Any], got: dict[str, Any]) -> str | None:
    """The first metric that differs (wall times and speeds aside), or None."""
    keep = lambda m: {k: v for k, v in m.items() if not k.startswith(VOLATILE)}  # noqa: E731
    a, b = keep(stored), keep(got)
    for key in sorted(a.keys() | b.keys()):
        x, y = a.get(key), b.get(key)
        if x != y and not (
            isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
        ):
            return f"metric {key}: stored {x!r}, replayed {y!r}"
    return None


def weights_difference(engine: Engine, store: RunStore, step: int) -> str | None:
    """The first weight tensor that differs from checkpoint step_N's (None: equal, or no
    such checkpoint)."""
    from safetensors.torch import load as st_load

    d = store.checkpoint_dir(step)
    if step not in store.checkpoints():
        return None
    stored = st_load(store.locate(d).get(f"{d}/actor/model.safetensors"))
    state = engine.actor.full_state_dict()
    for key in sorted(stored):
        if key not in state:
            return f"weights {key} (checkpoint step_{step}): not in the replayed policy"
        if not torch.equal(stored[key], state[key]):
            diff = (stored[key].double() - state[key].double()).abs().max().item()
            return f"weights {key} (checkpoint step_{step}): max |difference| {diff:.3g}"
    return None


class Replayer:
    """Stages of one run recomputed on `engine`, which starts at weights version 0."""

    def __init__(self, engine: Engine, store: RunStore) -> None:
        self.engine, self.store, self.cfg = engine, store, engine.cfg
        self.k = self.cfg.trainer.max_staleness

    def weights_at(self, version: int) -> None:
        """Make the engine hold weights version V of the run (it holds V or less now)."""
        have = self.engine.actor.weights_version
        if have > version or have < 0:
            raise RuntimeError(f"the engine holds version {have}, past {version}")
        usable = [c for c in self.store.checkpoints() if have < c <= version]
        for c in reversed(usable):
            if load_checkpoint(self.engine, self.store, c):
                have = c
                break
        for step in range(have + 1, version + 1):
            self.engine.update(self._input(step, "advantage"))

    def _input(self, step: int, stage: str) -> Batch:
        got = self.store.load_stage(step, stage)
        if got is None or got.batch is None:
            raise FileNotFoundError(f"{step}/{stage} of {self.store.run_id} is not committed")
        return got.batch

    def _kl_before(self, step: int) -> float:
        """The KL coefficient step N's advantage started from (what step N-1's left)."""
        before = self.store.load_stage(step - 1, "advantage") if step > 1 else None
        return before.meta["kl_coef"] if before else self.cfg.algorithm.kl_ctrl.kl_coef

    def replay(self, step: int, stage: str) -> Audit:
        """Recompute one committed stage (the engine must hold the weights it saw, or
        older: `weights_at` is called) and compare."""
        stored = self.store.load_stage(step, stage)
        if stored is None:
            return Audit(step, stage, None, "not committed: nothing to compare", 0.0)
        if (owner := self.store.locate(self.store.stage_dir(step, stage))) is not self.store:
            return Audit(step, stage, None, f"inherited from {owner.run_id} (replay it there)", 0.0)
        start = time.perf_counter()
        got, weights = self._recompute(step, stage, stored.meta)
        diff = None
        if stored.batch is not None:
            diff = first_difference(stored.batch, got)
        got_metrics = got.meta.get("metrics", {}) if isinstance(got, Batch) else got
        diff = diff or metric_difference(stored.meta.get("metrics", {}), got_metrics)
        if diff is None and stage == "update" and weights:
            diff = weights_difference(self.engine, self.store, step)
        seconds = time.perf_counter() - start
        return Audit(step, stage, diff is None, diff or "bit-equal", seconds)

    def _recompute(self, step: int, stage: str, meta: dict[str, Any]) -> tuple[Any, bool]:
        e = self.engine
        if stage == "rollout":
            self.weights_at(rollout_version(step, self.k) if e.feed is not None else step - 1)
            e.publish_weights()
            if self.cfg.algorithm.filter_groups.enabled:
                before = self.store.load_stage(step - 1, "rollout") if step > 1 else None
                first, prior = dynamic_start(before)
                return e.sample(step, first, prior=prior), False
            return e.rollout(step), False
        if stage == "reward":
            return e.reward(self._input(step, "rollout")), False
        if stage == "advantage":
            self.weights_at(step - 1)
            e.kl_ctrl.value = self._kl_before(step)
            return e.advantage(self._input(step, "reward")), False
        if stage == "update":
            self.weights_at(step - 1)
            return e.update(self._input(step, "advantage")), True
        if stage == "validate":
            self.weights_at(step)
            metrics = e.validate(self.cfg.tracking.val_samples)
            samples = metrics.pop("_samples", [])
            same = samples == meta.get("samples", samples)
            return metrics | ({} if same else {"samples": "differ"}), False
        raise ValueError(f"stage {stage!r}: one of {', '.join(STAGE_ORDER)}")


def audit_run(engine: Engine, store: RunStore) -> Iterator[Audit]:
    """Every committed stage of the run, replayed in the order the weights were made: at
    each version V the rollouts that used V, then step V+1's reward, advantage, update and
    validation. Yields each stage's audit as it is done. A fork's inherited stages are
    its parent's to audit (reported, not replayed)."""
    replayer = Replayer(engine, store)
    last = last_committed_update(store)
    k = replayer.k if engine.feed is not None else 0
    if store.is_committed(0, "validate"):
        yield replayer.replay(0, "validate")
    rolled = 0
    for version in range(0, last + 1):  # each replay brings the weights to what it needs
        while rolled < last + 1 and rollout_version(rolled + 1, k) <= version:
            rolled += 1
            if store.is_committed(rolled, "rollout"):
                yield replayer.replay(rolled, "rollout")
        step = version + 1
        if step > last:
            break
        for stage in ("reward", "advantage", "update"):
            yield replayer.replay(step, stage)
        if store.is_committed(step, "validate"):
            yield replayer.replay(step, "validate")


def materialize(engine: Engine, store: RunStore, version: int) -> str:
    """A new fork's own checkpoint of weights version V, made by `engine` with its parent's
    config: the newest inherited checkpoint plus the inherited updates after it, applied as
    the parent applied them. A fork that changes what the update reads starts from it
    (replaying those updates with the fork's values would give other weights)."""
    Replayer(engine, store).weights_at(version)
    if version:
        engine.kl_ctrl.value = store.load_stage(version, "advantage").meta["kl_coef"]
    return save_checkpoint(engine, store, version)
