"""A worker group: the ranks of one role group of the pool, called together (split / gather the
batch, wait with the stage's time limit); the errors a lost worker raises live in
`hybrid_engine.errors`."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from hybrid_engine.batch import Batch
from hybrid_engine.config import HybridConfig
from hybrid_engine.errors import STOPPING, CallsAbandoned, WorkerDiedError, WorkerHungError
from hybrid_engine.models.loading import load_tokenizer
from hybrid_engine.pool.claim import driver_id, taken
from hybrid_engine.pool.dispatch import gather_rows, mean_metrics, split_for_update, split_rows


# ---------------------------------------------------------------------- worker groups
class StageLimit(threading.local):
    """How long a call of the running stage may take (shared by a pool's groups), per
    thread: a rollout running beside the update has its own stage's limit."""

    def __init__(self, seconds: float, why: str) -> None:  # run again in each thread
        self.seconds, self.why = seconds, why


class WorkerGroup:
    """The ranks of one group: call a method on all of them, split / gather the batch."""

    def __init__(self, cfg: HybridConfig, name: str, handles: list[Any]) -> None:
        self.cfg, self.name, self.handles = cfg, name, handles
        self.pool_name = cfg.ray.pool_name
        self.pids = [0] * len(handles)  # filled in once the workers answer
        self.limit = StageLimit(cfg.ray.call_timeout_s, "ray.call_timeout_s")
        self.claim: Any = None  # the driver's PoolClaim, when it holds one
        # sent with each call (`Worker.call`); per run where runs share the pool
        self.driver = driver_id(cfg.trainer.run_id, per_run=cfg.ray.when_busy == "share")

    @functools.cached_property
    def pad_token_id(self) -> int:
        """Fills token-id fields when ranks' results are gathered (read on first use)."""
        return load_tokenizer(self.cfg.model).pad_token_id

    @property
    def ranks(self) -> int:
        return len(self.handles)

    def wait(self, refs: list[Any], what: str, timeout_s: float | None = None) -> list[Any]:
        """Results in rank order. A dead worker raises at once (WorkerDiedError); no answer
        within `timeout_s` (else the stage's limit, else `ray.call_timeout_s`) raises
        WorkerHungError naming the workers that stopped answering; an exception raised in a
        worker is raised here as itself (its message, not Ray's traceback dump)."""
        if timeout_s is None:
            timeout_s, why = self.limit.seconds, self.limit.why
        else:
            why = "the start-up limit"
        if self.claim is not None:
            self.claim.check()
        deadline = time.monotonic() + timeout_s
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:  # in slices of a second: a signal (SIGTERM) is handled meanwhile
            if STOPPING.is_set() and threading.current_thread() is not threading.main_thread():
                raise CallsAbandoned(f"{what}: the driver is stopping")
            left = deadline - time.monotonic()
            if left <= 0:
                self._hung([index[r] for r in pending], what, timeout_s, why)
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(1.0, left))
            for ref in ready:
                i = index[ref]
                try:
                    results[i] = ray.get(ref)
                except RayActorError as e:
                    name = f"{self.name}-{i}"
                    raise WorkerDiedError(
                        f"{what}: worker {name} (pid {self.pids[i]}) of pool "
                        f"{self.pool_name!r} died ({type(e).__name__})",
                        name,
                        "died",
                    ) from None
                except RayTaskError as e:
                    self._check_peers(what)  # a collective broken by a dead peer
                    raise e.cause from None  # e.g. NonFiniteUpdate, with its own message
        return results

    def _hung(self, ranks: list[int], what: str, timeout_s: float, why: str) -> None:
        """Raise WorkerHungError naming the waited-for workers that do not even answer a
        status call (a rank stuck in a collective behind a stopped peer still answers)."""
        silent = [i for i in ranks if not self._answers(i)] or ranks
        names = [f"{self.name}-{i} (pid {self.pids[i]})" for i in silent]
        raise WorkerHungError(
            f"{what}: {', '.join(names)} of pool {self.pool_name!r} did not answer within "
            f"{timeout_s:.0f} s ({why})",
            f"{self.name}-{silent[0]}",
            "hung",
        )

    def _check_peers(self, what: str) -> None:
        """A rank's error can be a symptom (gloo: "Connection closed by peer"): if a rank
        of the group is dead or silent, that is the fault to report."""
        for i in range(self.ranks):
            if not self._answers(i):
                name = f"{self.name}-{i}"
                raise WorkerDiedError(
                    f"{what}: worker {name} (pid {self.pids[i]}) of pool {self.pool_name!r} "
                    "died or stopped answering (its peers' collectives failed)",
                    name,
                    "died",
                )

    def _answers(self, rank: int) -> bool:
        try:
            ray.get(self.handles[rank].info.remote(), timeout=5.0)
            return True
        except (RayActorError, GetTimeoutError):
            return False

    def turn(self) -> contextlib.AbstractContextManager[None]:
        """This run's turn on a shared pool for a call (re-entrant: a stage holds one)."""
        return self.claim.turn() if self.claim is not None else contextlib.nullcontext()

    def call_all(self, role: str, method: str, *args: Any) -> list[Any]:
        with self.turn():
            refs = [h.call.remote(role, method, *args, driver=self.driver) for h in self.handles]
            return self.wait(refs, f"{role}.{method}")

    def call_split(self, role: str, method: str, batch: Batch, *args: Any) -> Batch:
        parts, pad = split_rows(batch, self.ranks)
        with self.turn():
            refs = [
                h.call.remote(role, method, p, *args, driver=self.driver)
                for h, p in zip(self.handles, parts, strict=True)
            ]
            done = self.wait(refs, f"{role}.{method}")
        return gather_rows(done, pad, self.pad_token_id)

    def call_update(self, role: str, method: str, batch: Batch, mini_batch_size: int) -> dict:
        parts = split_for_update(batch, self.ranks, mini_batch_size)
        with self.turn():
            refs = [
                h.call.remote(role, method, p, driver=self.driver)
                for h, p in zip(self.handles, parts, strict=True)
            ]
            return mean_metrics(self.wait(refs, f"{role}.{method}"))

    def role_info(self, role: str, what: str) -> dict:
        """Rank 0's report on `role`; PoolTaken when another driver configured it since."""
        with self.turn():
            info = self.wait([self.handles[0].info.remote()], what)[0]
        if (info.get("driver") or {}).get("owner") != self.driver["owner"]:
            raise taken(self.pool_name, f"{self.name}-0", info.get("driver"), self.driver["run"])
        return info[role]

    def info(self, timeout_s: float = 10.0) -> list[dict]:
        """Each rank's report; a dead or unresponsive one is reported, not raised."""
        out = []
        for i, h in enumerate(self.handles):
            try:
                out.append(ray.get(h.info.remote(), timeout=timeout_s))
            except (RayActorError, GetTimeoutError) as e:
                out.append(
                    {
                        "name": f"{self.name}-{i}",
                        "group": self.name,
                        "rank": i,
                        "pid": self.pids[i],
                        "healthy": False,
                        "error": type(e).__name__,
                    }
                )
        return out
