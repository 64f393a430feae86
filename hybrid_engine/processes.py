"""Whether a process recorded by (pid, start time) still runs on this host."""

from __future__ import annotations

import psutil


def alive(pid: int, started: float) -> bool:
    """Process `pid`, started at `started`, still runs here: a zombie does not, and a pid
    reused by another process is not it."""
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
