"""What a killed driver left behind: the servers a driver started, recorded in run.json, so
the next driver of the run can end what a SIGKILL left running."""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any

import psutil

log = logging.getLogger("hybridrl.recovery")


def driver_record() -> dict[str, Any]:
    """This driver and the servers it started (Prefect's ephemeral API is a child process):
    kept in run.json, so the next driver of the run can end what a SIGKILL left running."""
    me = psutil.Process()
    servers = []
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(child.cmdline())
            if "uvicorn" in cmd or "prefect" in cmd:
                servers.append({"pid": child.pid, "started": child.create_time()})
    return {
        "host": socket.gethostname(),
        "pid": me.pid,
        "started": me.create_time(),
        "servers": servers,
    }


def clean_up_after(previous: dict[str, Any] | None) -> list[int]:
    """End the servers a dead driver of this run left on this machine (same pid and start
    time: a reused pid is left alone). Returns the pids ended."""
    if not previous or previous.get("host") != socket.gethostname():
        return []
    if _alive(previous["pid"], previous["started"]):
        return []  # that driver still runs (another resume of the same run?): not ours to end
    ended = []
    for server in previous.get("servers", []):
        if _alive(server["pid"], server["started"]):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(server["pid"])
                proc.terminate()
                try:
                    proc.wait(10)
                except psutil.TimeoutExpired:
                    proc.kill()
                ended.append(server["pid"])
    if ended:
        log.warning(
            "ended the Prefect server process(es) %s left by the killed driver (pid %d)",
            ended,
            previous["pid"],
        )
    return ended


def _alive(pid: int, started: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.Error:
        return False
