"""Named fault points, for testing what a real fault does to a run.

`HYBRIDRL_FAULT="<point>=<action>[;<point>=<action>...]"` makes the driver act when it
reaches `<point>`, once per process:

    step-2/reward:before_commit=kill          SIGKILL this process (objects written, no marker)
    step-3:end=kill                           between steps (after checkpoint and latest.json)
    step-2/rollout:before_commit=pause:FILE   create FILE and wait until someone deletes it
    step-2/update:start=kill-worker:actor-1   SIGKILL pool worker actor-1 (`@0.5`: half a
                                              second later, from a thread: mid-call)
    step-3/rollout:start=kill-worker:rollout-0@generating
                                              SIGKILL it once it is generating (it reports
                                              sampled tokens): certainly mid-call
    step-3/rollout:start=stop-worker:actor-0  SIGSTOP pool worker actor-0 (a hang)
    step-2/rollout:start=kill-engine@0.1      SIGKILL this machine's vLLM engine processes
                                              (`@s`: that much later, from a thread)
    step-4/reward:start=term                  SIGTERM this process (a preemption)
    step-5/advantage:batch=nan                NaN in the first row's advantages before the
                                              advantage stage commits (a data fault: the
                                              stored stage holds it, so replays see it too)

Points: `driver:start-engine` (the driver starts its engine: a new run has no run.json yet),
`step-<N>/<stage>:start` (a stage task begins), `step-<N>/<stage>:before_commit`
(every stage commit), `step-<N>:end` (after step N and its checkpoint),
`step-<N>/rollout:turn-<k>` (a multi-turn rollout after its turn k), `step-<N>/advantage:batch`
(`fault_batch`). Unset (the normal case), a point costs one dictionary lookup. With
`HYBRIDRL_FAULT_LOG=<file>` each fault that fires appends its spec there (the chaos
benchmark restarts a preempted driver without the faults that already happened).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

_fired: set[str] = set()


def _due(name: str) -> list[tuple[str, str]]:
    """(action, spec) of the faults at point `name` that have not fired in this process."""
    spec = os.environ.get("HYBRIDRL_FAULT")
    if not spec:
        return []
    due = []
    for one in spec.split(";"):
        point, _, action = one.strip().partition("=")
        if point == name and one not in _fired:
            _fired.add(one)
            if log := os.environ.get("HYBRIDRL_FAULT_LOG"):
                with open(log, "a") as f:
                    f.write(one.strip() + "\n")
            due.append((action, one))
    return due


def fault_point(name: str) -> None:
    for action, spec in _due(name):
        _act(action, name, spec)


def fault_batch(name: str, batch: Any) -> Any:
    """`<point>=nan`: the batch with NaN advantages in its first row."""
    for action, _ in _due(name):
        if action != "nan":
            raise ValueError(f"HYBRIDRL_FAULT: {name} takes only the action 'nan'")
        batch["advantages"][0] = float("nan")
    return batch


def _act(action: str, name: str, spec: str) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif action.startswith("pause:"):
        flag = Path(action.removeprefix("pause:"))
        flag.write_text(name)
        while flag.exists():
            time.sleep(0.05)
    elif action.startswith(("kill-worker:", "stop-worker:")):
        kind, _, target = action.partition(":")
        worker, _, delay = target.partition("@")
        sig = signal.SIGKILL if kind == "kill-worker" else signal.SIGSTOP
        pid = worker_pid(worker)
        if delay == "generating":
            args = (worker, pid, sig, spec)
            threading.Thread(target=_when_generating, args=args, daemon=True).start()
        elif delay:
            threading.Timer(float(delay), os.kill, (pid, sig)).start()
        else:
            os.kill(pid, sig)
    elif action.partition("@")[0] == "kill-engine":
        threading.Timer(float(action.partition("@")[2] or 0), _kill_engines, (spec,)).start()
    else:
        raise ValueError(
            f"HYBRIDRL_FAULT={spec!r}: action must be kill, term, pause:<file>, "
            "kill-worker:<name>[@s|@generating], stop-worker:<name>[@s|@generating] "
            "or kill-engine[@s]"
        )


def _kill_engines(spec: str) -> None:
    """SIGKILL every vLLM engine process on this machine (Ray actors of `VLLMServer`)."""
    import psutil

    pids = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any("VLLMServer" in a for a in p.info["cmdline"] or []):
                p.kill()
                pids.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    if log := os.environ.get("HYBRIDRL_FAULT_LOG"):
        with open(log, "a") as f:
            f.write(f"{spec.strip()}: killed engine(s) {pids}\n")


def _when_generating(worker: str, pid: int, sig: int, spec: str, timeout_s: float = 300) -> None:
    """Signal the worker once its rollout reports progress (it is inside `generate`); the
    fault log (`HYBRIDRL_FAULT_LOG`) gets how far its generation had come."""
    import ray

    handle, role = _worker_handle(worker), worker.rsplit("-", 1)[0]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        progress = ray.get(handle.rollout_progress.remote(role), timeout=30)
        if progress is not None:
            os.kill(pid, sig)
            if log := os.environ.get("HYBRIDRL_FAULT_LOG"):
                with open(log, "a") as f:
                    f.write(f"{spec.strip()}: signalled while generating ({progress})\n")
            return
        time.sleep(0.002)
    raise TimeoutError(f"HYBRIDRL_FAULT: {worker} did not generate within {timeout_s} s")


def worker_pid(worker: str) -> int:
    """The pid of the pool worker named `worker` (e.g. actor-1) on the connected Ray cluster."""
    import ray

    return ray.get(_worker_handle(worker).info.remote(), timeout=30)["pid"]


def _worker_handle(worker: str) -> Any:
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"] == worker and a["namespace"].startswith("hybridrl-"):
            return ray.get_actor(worker, namespace=a["namespace"])
    raise LookupError(f"no pool worker named {worker!r}")
