"""The asynchronous scheduler (`trainer.max_staleness` = k > 0): step N+k+1's rollout is submitted
as soon as update(N) made the weights it uses, and runs beside the next k steps' reward,
advantage and update; step N+k+1 takes its result when it starts."""

from __future__ import annotations

import contextlib
from typing import Any

from hybrid_engine.engine import Engine
from hybrid_engine.errors import CallsAbandoned
from hybrid_engine.staleness import rollout_version
from storage.store import RunStore


class RolloutsAhead:
    """Asynchronous training (trainer.max_staleness = k > 0): the rollout of step M uses
    weights version M-1-k (`hybrid_engine.staleness`), so it is submitted to run in the
    background as soon as the trainer holds that version, each after the one before (the
    rollout group generates one at a time). With k = 0 each rollout runs when its step starts."""

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

    def rollout(self, step: int, after: Any = None) -> Any:
        """Step N's rollout: the one submitted ahead (asynchronous), or run now once `after`
        (the previous update or validation) is done."""
        if self.k:
            return self.take(step)
        self.publish_for(step)  # a separate rollout group (colocated: nothing)
        return self.task(self.engine, self.store, step, wait_for=[after] if after else None)

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
        self.launch()  # asynchronous: the rollouts the weights held now are for
        return self

    def __exit__(self, *exc: Any) -> None:
        """However the steps ended, no rollout is left running (a recovery re-creates the
        pool next; a preempted driver's rollouts give up at once, `pool.STOPPING`)."""
        for future in self.futures.values():
            with contextlib.suppress(Exception, CallsAbandoned):  # the steps' error goes on
                future.wait()
        self.futures.clear()
