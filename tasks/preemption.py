"""Preemption: while the train flow runs, SIGTERM raises Preempted in the flow's thread; a
commit in progress finishes first (storage.store.critical), nothing is left half-committed,
and the flow run ends in state "Preempted"."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from hybrid_engine.errors import STOPPING
from storage.store import critical
from tasks.stage_clock import CLOCK


class Preempted(BaseException):
    """SIGTERM reached the driver. A BaseException, like KeyboardInterrupt: no `except
    Exception` on the way (a task's retry, a library's fallback) may swallow it."""


@contextlib.contextmanager
def preemption() -> Iterator[None]:
    """While the block runs, SIGTERM raises Preempted in this thread (after a commit in
    progress, which `critical()` holds it back for). Off the main thread (where Python
    cannot take signals) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        _term_at[:] = [CLOCK.where or "start-up"]
        STOPPING.set()  # a rollout waited for in another thread gives up
        critical.pending = True
        if not critical.depth:
            critical.pending = False
            raise Preempted(f"SIGTERM at {CLOCK.where or 'start-up'}")

    STOPPING.clear()
    _term_at.clear()
    before = signal.signal(signal.SIGTERM, on_term)
    critical.on_exit = _raise_pending
    _armed.append(on_term)
    try:
        yield
    finally:
        _armed.remove(on_term)
        signal.signal(signal.SIGTERM, before)
        critical.on_exit = None


_armed: list[Any] = []
_term_at: list[str] = []  # where the SIGTERM of this `preemption()` block arrived


def as_preempted(e: BaseException) -> Preempted | None:
    """`e` as the preemption it is: Preempted itself, or the error Prefect's engine made of
    it when the SIGTERM landed inside the engine's own code (a task run's state handling
    raises e.g. "Task run is not set"); None when no SIGTERM arrived."""
    if isinstance(e, Preempted):
        return e
    if _term_at:
        return Preempted(f"SIGTERM at {_term_at[0]} ({type(e).__name__} in Prefect's engine)")
    return None


def rearm() -> None:
    """Put our SIGTERM handler back (`ray.init` installs its own, which exits the process)."""
    if _armed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _armed[-1])


def _raise_pending() -> None:
    if critical.pending:
        critical.pending = False
        raise Preempted(f"SIGTERM at {CLOCK.where or 'start-up'}")
