"""`hybridrl deploy`: the deployments of `deployments/prefect.yaml` on a running Prefect server.

    1. the server is the one PREFECT_API_URL names, and it answers (deployments need a
       server that outlives this process: the ephemeral API would forget them)
    2. every deployment's preset and overrides make a valid config (the error names the
       deployment and the key, before anything is created)
    3. the process work pool each deployment names exists (created if missing)
    4. `prefect deploy` with HYBRIDRL_HOME set to this checkout, where the worker will run
       the flow (the yaml's `pull` step changes into it); each deployment's `triggers`
       become Prefect automations (a preempted training resumes itself; a finished training
       that registered its policy gets evaluated by `evaluate-on-finish`)

It returns the deployments it deployed (name, schedules); the CLI prints the next commands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILE = ROOT / "deployments" / "prefect.yaml"


class DeployError(RuntimeError):
    """A deployment could not be made; the message says what to do."""


def api_url() -> str:
    """The server's API URL, checked to answer."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise DeployError(
            "PREFECT_API_URL is not set: deployments live on a Prefect server. Start one "
            "(`prefect server start --host 127.0.0.1 --port 4200`) and "
            "`export PREFECT_API_URL=http://127.0.0.1:4200/api`"
        )
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=10) as r:
            json.loads(r.read())
    except (OSError, ValueError) as e:
        raise DeployError(
            f"the Prefect server at PREFECT_API_URL={url} does not answer ({e})"
        ) from None
    return url


def read_deployments(path: Path, names: list[str]) -> list[dict[str, Any]]:
    """The yaml's deployments (all, or those named), each config checked."""
    from hybrid_engine.config import ConfigError, load_config

    if not path.is_file():
        raise DeployError(f"{path} does not exist (`hybridrl deploy` runs from a checkout)")
    found = yaml.safe_load(path.read_text()).get("deployments") or []
    by_name = {d["name"]: d for d in found}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise DeployError(
            f"no deployment {', '.join(map(repr, unknown))} in {path} "
            f"(it has: {', '.join(by_name)})"
        )
    chosen = [by_name[n] for n in names] if names else found
    for d in chosen:
        params = d.get("parameters") or {}
        if "config" not in params:  # not a training: nothing to check here
            continue
        try:
            load_config(str(ROOT / params["config"]), params.get("overrides") or [])
        except (ConfigError, KeyError, OSError) as e:
            raise DeployError(f"deployment {d['name']!r}: {e}") from None
    return chosen


def flow_name(deployment: dict[str, Any]) -> str:
    """The Prefect flow name of a deployment's entrypoint (`flows/train.py:train` -> train)."""
    return deployment["entrypoint"].rsplit(":", 1)[1]


def ensure_pools(deployments: list[dict[str, Any]]) -> list[str]:
    """Create each missing process work pool; returns the names created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    created = []
    with get_client(sync_client=True) as client:
        for name in sorted({d["work_pool"]["name"] for d in deployments}):
            try:
                client.read_work_pool(name)
            except ObjectNotFound:
                client.create_work_pool(WorkPoolCreate(name=name, type="process"))
                created.append(name)
    return created


def deploy(names: list[str], path: Path = DEFAULT_FILE) -> dict[str, Any]:
    """Steps 1-4; returns the server URL, the pools created and the deployments made."""
    url = api_url()
    chosen = read_deployments(path, names)
    created = ensure_pools(chosen)
    which = [a for d in chosen for a in ("--name", d["name"])] if names else ["--all"]
    cmd = [
        str(Path(sys.executable).parent / "prefect"),
        "--no-prompt",
        "deploy",
        "--prefect-file",
        str(path),
        *which,
    ]
    env = {**os.environ, "HYBRIDRL_HOME": str(ROOT), "PREFECT_API_URL": url}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
        raise DeployError("prefect deploy failed: " + " | ".join(tail))
    return {
        "api_url": url,
        "pools_created": created,
        "home": str(ROOT),
        "deployments": [
            {
                "name": f"{flow_name(d)}/{d['name']}",
                "pool": d["work_pool"]["name"],
                "schedules": [
                    s.get("cron") or s.get("interval") or s.get("rrule")
                    for s in d.get("schedules") or []
                ],
            }
            for d in chosen
        ],
    }
