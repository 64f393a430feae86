"""The engine's errors and constants that the layers above catch or read: what a lost worker
raises, the driver's stop signal, and the errnos of a storage that cannot take an object.
Standard library only, so `tasks/`, `flows/` and `storage/` import them without the pool."""

from __future__ import annotations

import errno
import threading


class PoolError(RuntimeError):
    """The pool cannot serve the request (mismatch, missing or dead worker, timeout)."""


class WorkerLostError(PoolError):
    """A worker is gone or stopped answering: the pool must be re-created (the flow's
    recovery does that by itself, `pipeline.max_recoveries` times)."""

    def __init__(self, message: str, worker: str, how: str) -> None:
        super().__init__(message)
        self.worker, self.how = worker, how  # e.g. "actor-1", "died" | "hung"
        self.where: tuple[str, int] | None = None  # the stage task it ended ("step-3/rollout", 3)


class WorkerDiedError(WorkerLostError):
    """A worker process is gone; the message names it."""


class WorkerHungError(WorkerLostError):
    """A worker did not answer within the stage's time limit (stopped, deadlocked, or a
    peer of a dead rank waiting in a collective)."""


class EngineLostError(ConnectionError):
    """A rollout engine in a process of its own (vLLM) died mid-call and a fresh one was
    started: transient (an OSError), so the stage task is retried."""


class CallsAbandoned(BaseException):  # noqa: N818 - a stop, like KeyboardInterrupt
    """The driver is stopping (SIGTERM): a call waited for off the main thread (a rollout
    running beside the update) gives up instead of holding the driver until it ends."""


STOPPING = threading.Event()  # set by the driver's SIGTERM handler (tasks.preemption)

NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # the storage cannot take the object
