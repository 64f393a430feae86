"""The Ray cluster the pool runs on: an existing one (`ray.address` / `$RAY_ADDRESS`) or a
local head started as a background process (`ray start --head` on 127.0.0.1), its address and
temp dir recorded in `<state dir>/head.json` so that it and the actors on it outlive the
driver that started it; `stop_local_head` ends it and every process it started.

One state dir, one head: drivers that start at once take `<state dir>/head.lock` and the
second finds the head the first started. Every head and node temp dir carries the state
dir's `tag`, so `local_heads` sees a head whose record was lost and `stop_local_head` stops
it too.
`add_local_node` gives that cluster more nodes on this machine (each its own raylet), for
multi-node tests and benchmarks; `remove_local_node` stops one, gently or as a lost machine."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import ray
from ray._private import ray_constants
from ray._private.services import node_ip_address_from_perspective

from hybrid_engine import RAY_ENV
from hybrid_engine.config import HybridConfig
from hybrid_engine.errors import PoolError
from hybrid_engine.models.loading import cache_dir

log = logging.getLogger("hybridrl.pool")


# ---------------------------------------------------------------------- the local head
def state_dir() -> Path:
    return Path(os.environ.get("HYBRIDRL_RAY_STATE") or cache_dir() / "ray").expanduser()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports: each socket stays bound until all are picked (one at a time,
    the system may hand the same port out twice, and Ray refuses a port given to two parts)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def _port_open(address: str, timeout: float = 1.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def tag() -> str:
    """This state dir's mark in the name of every head and node temp dir it starts (short:
    Ray's socket paths under the temp dir must stay below 108 bytes)."""
    return hashlib.sha1(str(state_dir().resolve()).encode()).hexdigest()[:6]


def _temp_dir(kind: str) -> str:
    return tempfile.mkdtemp(prefix=f"hrl-ray-{tag()}-{kind}-", dir="/tmp")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """The state dir's head lock: one process at a time finds, starts or stops the head."""
    state_dir().mkdir(parents=True, exist_ok=True)
    with (state_dir() / "head.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def local_heads() -> list[dict]:
    """Every live head this state dir started, recorded or not: {address, temp_dir, pids,
    recorded}. More than one means a head was started by code without the lock."""
    state = state_dir() / "head.json"
    recorded = json.loads(state.read_text())["temp_dir"] if state.is_file() else None
    dirs = {str(d) for d in Path("/tmp").glob(f"hrl-ray-{tag()}-h-*")} | {recorded} - {None}
    heads = []
    for d in sorted(dirs):
        procs = head_processes(d)
        port = None
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                for a in p.cmdline():
                    if a.startswith("--gcs_server_port="):
                        port = a.split("=", 1)[1]
        if port is not None:
            heads.append(
                {
                    "address": f"127.0.0.1:{port}",
                    "temp_dir": d,
                    "pids": sorted(p.pid for p in procs),
                    "recorded": d == recorded,
                }
            )
    return heads


def local_head(start: bool, num_cpus: int = 16, timeout_s: float = 120) -> str | None:
    """Address of this machine's hybridrl head; started in the background if `start`."""
    with _locked():
        state = state_dir() / "head.json"
        if state.is_file():
            info = json.loads(state.read_text())
            if _port_open(info["address"]):
                return info["address"]
        for h in local_heads():  # alive, its record lost: adopt it
            if _port_open(h["address"]):
                state.write_text(json.dumps({"address": h["address"], "temp_dir": h["temp_dir"]}))
                return h["address"]
        _stop_heads()  # stale: their processes are gone or half gone
        return _start_head(num_cpus, timeout_s) if start else None


def _start_head(num_cpus: int, timeout_s: float) -> str:
    port, dashboard = free_ports(2)
    temp_dir = _temp_dir("h")
    cmd = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={num_cpus}",
        "--disable-usage-stats",
        "--include-dashboard=false",
        f"--dashboard-port={dashboard}",
        f"--temp-dir={temp_dir}",
    ]
    env = {**RAY_ENV, **os.environ}  # the user's RAY_AUTH_MODE (e.g. token) wins
    env.pop("HYBRIDRL_FAULT", None)  # crash points are the driver's (storage/faults.py)
    # its own session: the head outlives the driver, and Ctrl-C (SIGINT to the terminal's
    # process group) or a kill of the driver's group does not reach it
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout_s, start_new_session=True
    )
    if proc.returncode != 0:
        _end(head_processes(temp_dir), kill=True)  # what it started before it failed
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise PoolError(f"`ray start --head` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    address = f"127.0.0.1:{port}"
    (state_dir() / "head.json").write_text(json.dumps({"address": address, "temp_dir": temp_dir}))
    mode = env["RAY_AUTH_MODE"]
    log.info(
        "started a local Ray head on %s (loopback only), RAY_AUTH_MODE=%s%s",
        address,
        mode,
        " (export RAY_AUTH_MODE=token for token auth)" if mode != "token" else "",
    )
    return address


def head_processes(temp_dir: str) -> list[psutil.Process]:
    """The head's daemons (their command lines name its temp dir) and their children."""
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in a for a in p.info["cmdline"] or []):
                found[p.pid] = p
                for c in p.children(recursive=True):
                    found[c.pid] = c
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return list(found.values())


def stop_local_head() -> bool:
    """Stop every head this state dir started (the recorded one and any whose record was
    lost) with the nodes added to them: only their own processes. True if one was."""
    with _locked():
        return _stop_heads()


def _stop_heads() -> bool:
    state = state_dir() / "head.json"
    dirs = {str(d) for d in Path("/tmp").glob(f"hrl-ray-{tag()}-*")}
    if state.is_file():
        dirs.add(json.loads(state.read_text())["temp_dir"])  # one an older version started
    if not dirs and not local_nodes():
        return False
    if ray.is_initialized():
        ray.shutdown()
    for name in local_nodes():  # the nodes added to its cluster go with it
        remove_local_node(name)
    for d in dirs:
        _end(head_processes(d), kill=False)
        shutil.rmtree(d, ignore_errors=True)
    state.unlink(missing_ok=True)
    return True


# ------------------------------------------------- more nodes of the local cluster
def _nodes_dir() -> Path:
    return state_dir() / "nodes"


def local_nodes() -> dict[str, dict]:
    """The nodes `add_local_node` started and recorded, by name."""
    d = _nodes_dir()
    return (
        {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))} if d.is_dir() else {}
    )


def add_local_node(
    name: str, num_cpus: int, resources: dict[str, float], timeout_s: float = 120
) -> dict:
    """Another Ray node of the local head's cluster on this machine: its own raylet, object
    store and workers (`hybrid_engine.pool.node`, ports of its own), offering `num_cpus` CPUs
    and the custom `resources`. A real second node of the cluster's topology, sharing the
    machine's cores and disk with the head."""
    head = local_head(start=False)
    if head is None:
        raise PoolError("no local Ray head to add a node to (`hybridrl cluster up` starts one)")
    if name in local_nodes():
        raise PoolError(f"a local node named {name!r} exists; remove it first")
    temp_dir = _temp_dir(f"n-{name}")
    ports = (
        "node_manager_port",
        "object_manager_port",
        "dashboard_agent_listen_port",
        "metrics_agent_port",
        "metrics_export_port",
        "runtime_env_agent_port",
    )
    config = {
        "name": name,
        "num_cpus": num_cpus,
        "resources": resources,
        "temp_dir": temp_dir,
        "ports": dict(zip(ports, free_ports(len(ports)), strict=True)),
    }
    env = {**RAY_ENV, **os.environ}  # the head's auth mode, where the user set one
    env.pop("HYBRIDRL_FAULT", None)
    log = Path(temp_dir) / "start.log"  # a file, not a pipe: the raylet would hold a pipe open
    with log.open("w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "hybrid_engine.pool.node", head, json.dumps(config)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            start_new_session=True,
        )
    if proc.returncode != 0:
        _end(head_processes(temp_dir), kill=True)
        text = log.read_text()[-2000:]
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise PoolError(f"node {name!r} did not start ({proc.returncode}):\n{text}")
    info = {"name": name, "temp_dir": temp_dir, "num_cpus": num_cpus, "resources": resources}
    _nodes_dir().mkdir(parents=True, exist_ok=True)
    (_nodes_dir() / f"{name}.json").write_text(json.dumps(info))
    return info


def remove_local_node(name: str, kill: bool = False) -> bool:
    """Stop a node `add_local_node` started: its raylet and everything it runs (the pool's
    workers on it die with it). `kill` = SIGKILL at once, as a machine lost would; else
    SIGTERM first. False if there is no such node."""
    path = _nodes_dir() / f"{name}.json"
    if not path.is_file():
        return False
    info = json.loads(path.read_text())
    _end(head_processes(info["temp_dir"]), kill)
    shutil.rmtree(info["temp_dir"], ignore_errors=True)
    path.unlink(missing_ok=True)
    return True


def _end(procs: list[psutil.Process], kill: bool, grace_s: float = 2.0) -> None:
    """SIGKILL, or SIGTERM and SIGKILL what is left after `grace_s`. Ray 2.60's agents and
    dashboard exit within ~2 s of a SIGTERM; its gcs_server and autoscaler monitor ignore
    it, and the raylet then waits ~12 s for them (measured): the head holds nothing that a
    longer wait would save (the pool's state is in storage)."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def connect(cfg: HybridConfig, start: bool = True) -> str | None:
    """Join the configured cluster, else the local head (started if `start`)."""
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if not address:
        address = local_head(start, cfg.ray.head_num_cpus, cfg.ray.start_timeout_s)
        if address is None:
            return None
    if not ray.is_initialized():
        # The driver attaches through the raylet of its own node, found by this node's
        # address: 127.0.0.1 for a local head; else the address the cluster sees this machine
        # at (what Ray itself picks on Linux, but RAY_ENV's switch, which keeps a local head
        # on loopback, would make it 127.0.0.1 and the driver would find no raylet).
        local = address.startswith("127.0.0.1:")
        if local and ray_constants.ENABLE_RAY_CLUSTER:
            # read once when ray is imported: a driver that imported ray before hybrid_engine
            # would look for the head on the host address and wait there for minutes
            raise PoolError(
                "ray was imported before hybrid_engine without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0:"
                " import hybrid_engine first, or set that variable, to reach the local head"
            )
        ray.init(
            address=address,
            namespace="hybridrl",
            log_to_driver=False,
            logging_level="WARNING",
            _node_ip_address="127.0.0.1" if local else node_ip_address_from_perspective(address),
        )
    return address
