"""One state dir, one local Ray head: drivers that start at the same moment share one head,
and `stop_local_head` (what `pool down` and `cluster down` call) stops a head whose record
in `head.json` was lost, leaving none of its processes behind."""

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import PRISTINE_ENV

ROOT = Path(__file__).parents[1]
STARTER = """
import sys, time
import hybrid_engine
from hybrid_engine.pool.cluster import local_head
at = float(sys.argv[1])
time.sleep(max(0.0, at - time.time()))  # all start together
print(local_head(start=True, num_cpus=1))
"""


def gcs_servers(port: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        if "gcs_server" in (p.info["name"] or "") and any(
            a == f"--gcs_server_port={port}" for a in p.info["cmdline"] or []
        ):
            out.append(p)
    return out


def kill_heads(ports: set[str]) -> None:
    """Whatever the code under test left behind: each head's gcs_server and its session."""
    for port in ports:
        for p in gcs_servers(port):
            temp = next(a.split("=", 1)[1] for a in p.cmdline() if a.startswith("--log_dir="))
            session = temp.split("/session_")[0]
            for q in psutil.process_iter(["cmdline"]):
                if any(session in a for a in q.info["cmdline"] or []):
                    q.kill()


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDRL_RAY_STATE", str(tmp_path / "raystate"))
    return {
        **PRISTINE_ENV,
        "PYTHONPATH": str(ROOT),
        "HYBRIDRL_RAY_STATE": str(tmp_path / "raystate"),
    }


def test_drivers_starting_at_once_share_one_head(state):
    at = time.time() + 8  # after the three interpreters have imported hybrid_engine
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STARTER, str(at)],
            env=state,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    addresses = {out.strip().splitlines()[-1] for out, _ in outs if out.strip()}
    ports = {a.rsplit(":", 1)[1] for a in addresses}
    try:
        assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
        assert len(addresses) == 1, f"three drivers started {len(addresses)} heads: {addresses}"
        assert len(gcs_servers(ports.pop())) == 1
    finally:
        from hybrid_engine.pool.cluster import stop_local_head

        stop_local_head()
        left = [
            p.pid for port in {a.rsplit(":", 1)[1] for a in addresses} for p in gcs_servers(port)
        ]
        kill_heads({a.rsplit(":", 1)[1] for a in addresses})
    assert not left, f"gcs_server left after stop_local_head: {left}"


def test_a_head_whose_record_was_lost_is_found_and_stopped(state):
    from hybrid_engine.pool.cluster import local_head, state_dir, stop_local_head

    address = local_head(start=True, num_cpus=1)
    port = address.rsplit(":", 1)[1]
    try:
        os.remove(state_dir() / "head.json")  # e.g. a driver of an older version overwrote it
        assert local_head(start=False) == address, "the live head was not found again"
        os.remove(state_dir() / "head.json")
        shown = subprocess.run(
            [sys.executable, "-m", "flows.cli", "cluster", "status"],
            env=state,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert f"local Ray head: {address}" in shown.stdout, shown.stdout + shown.stderr
        assert stop_local_head(), "stop_local_head saw no head"
        left = [p.pid for p in gcs_servers(port)]
    finally:
        kill_heads({port})
    assert not left, f"the head outlived stop_local_head: {left}"


@pytest.mark.fast
def test_ports_picked_together_are_distinct():
    """A node's six ports, picked one at a time, once came out twice (Ray refused the node:
    "metrics_export is trying to use a port number ... used by other components")."""
    from hybrid_engine.pool.cluster import free_ports

    for _ in range(20):
        ports = free_ports(6)
        assert len(set(ports)) == 6 and all(p > 0 for p in ports)
