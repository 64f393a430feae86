"""Prefect tasks, one per stage (`stages.py`: rollout, reward, advantage, update, validate)
and the run's checkpoints, restore and end (`checkpoint.py`).

Importing this package sets Prefect's environment defaults (before Prefect is imported):
its ephemeral API gets 120 s to start on a busy machine, and analytics stay off.
"""

import os

PREFECT_ENV = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
}
for _key, _value in PREFECT_ENV.items():
    os.environ.setdefault(_key, _value)
