"""Named crash points, for testing what a real crash does to a run.

`HYBRIDRL_FAULT="<point>=<action>"` makes the driver act when it reaches `<point>`:

    step-2/reward:before_commit=kill          SIGKILL this process (objects written, no marker)
    step-3:end=kill                           between steps (after checkpoint and latest.json)
    step-2/rollout:before_commit=pause:FILE   create FILE and wait until someone deletes it

Points: `step-<N>/<stage>:before_commit` (every stage commit), `step-<N>:end` (after step N
and its checkpoint), `step-<N>/rollout:turn-<k>` (a multi-turn rollout after its turn k). Unset (the normal case), a point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def fault_point(name: str) -> None:
    spec = os.environ.get("HYBRIDRL_FAULT")
    if not spec:
        return
    point, _, action = spec.partition("=")
    if point != name:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.startswith("pause:"):
        flag = Path(action.removeprefix("pause:"))
        flag.write_text(name)
        while flag.exists():
            time.sleep(0.05)
    else:
        raise ValueError(f"HYBRIDRL_FAULT={spec!r}: action must be 'kill' or 'pause:<file>'")
