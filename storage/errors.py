"""The storage errors a driver may meet writing its run (one line each)."""

from __future__ import annotations


class LeaseHeld(RuntimeError):
    """Another driver holds the run (or took it over from this one)."""


class ConditionalWriteError(RuntimeError):
    """The store cannot create an object only if none exists: it cannot give a run one
    writer."""


def unfit_line(root: str, why: str) -> str:
    return (
        f"storage.root={root!r}: the store {why} a conditional create (If-None-Match: *), "
        "so it cannot give a run one writer (two drivers could both take its lease); use a "
        "store that honours it, or set storage.single_driver=true if only one driver ever "
        "trains a run there"
    )
