"""Live progress of a training run, for whoever shows it (the CLI's rich display).

The flow announces the run and each finished step; the stage tasks announce each stage as it
starts and ends. Listeners registered with `listening(...)` receive these calls:

    run_started(run_id, start, total)         steps start..total are to run
    stage_started(step, stage, engine)        engine.rollout_progress() answers meanwhile
    stage_finished(step, stage, seconds, skipped)
    step_finished(step, metrics, line)

Nothing listens by default: a deployment's flow run logs its step lines and that is all.
A listener that raises is dropped with a warning; it never stops training.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("hybridrl.progress")
_listeners: list[Any] = []


@contextmanager
def listening(listener: Any) -> Iterator[Any]:
    """Send this process's progress events to `listener` while the block runs."""
    _listeners.append(listener)
    try:
        yield listener
    finally:
        if listener in _listeners:
            _listeners.remove(listener)


def emit(event: str, **kwargs: Any) -> None:
    """Call `event(**kwargs)` on every listener that has it."""
    for listener in list(_listeners):
        method = getattr(listener, event, None)
        if method is None:
            continue
        try:
            method(**kwargs)
        except Exception as e:  # a display problem must not fail a training run
            log.warning("progress display dropped after %s: %r", event, e)
            _listeners.remove(listener)
