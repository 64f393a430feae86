"""`hybridrl pool ...`: the persistent worker pool (its workers, the runs sharing it; stop
it). `hybridrl cluster ...`: the Ray cluster the pool runs on — its nodes, their resources
and which pool workers sit where; and, on one machine, a local cluster of several nodes (a
head plus nodes that are their own raylets) for multi-node tests and benchmarks."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.text import Text

from flows.cli.runs import console, fail
from hybrid_engine import RAY_ENV  # noqa: F401 - sets Ray's environment before ray is imported

cluster_app = typer.Typer(help="The Ray cluster: nodes, resources, where the pool's workers run.")


def _connected() -> bool:
    from hybrid_engine.config import load_config
    from hybrid_engine.pool.cluster import connect

    return connect(load_config(None, []), start=False) is not None


def workers_by_node() -> dict[str, list[str]]:
    """node id -> the pool workers on it (`<pool>/<worker>`), every hybridrl pool."""
    import ray

    from hybrid_engine.pool.pool import pool_status

    pools = sorted(
        {
            a["namespace"].removeprefix("hybridrl-")
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"].startswith("hybridrl-")
        }
    )
    out: dict[str, list[str]] = {}
    for pool in pools:
        for w in pool_status(pool):
            out.setdefault(w.get("node_id", "?"), []).append(f"{pool}/{w['name']}")
    return out


def heads_line() -> Text:
    """The local heads this machine's state dir started: one line, red when more than one
    (started by code without the head lock: `hybridrl cluster down` stops them all)."""
    from hybrid_engine.pool.cluster import local_heads

    heads = local_heads()
    shown = ", ".join(f"{h['address']}{'' if h['recorded'] else ' (unrecorded)'}" for h in heads)
    if len(heads) > 1:
        return Text(
            f"{len(heads)} local Ray heads: {shown}; `hybridrl cluster down` stops all", "red"
        )
    return Text(f"local Ray head: {shown}" if heads else "no local Ray head")


@cluster_app.command("status")
def status() -> None:
    """Each node: id, address, head or not, alive, CPUs and custom resources (free/total),
    and the pool workers on it."""
    import ray
    from rich.table import Table

    from hybrid_engine.config.infra import RAY_BUILTIN_RESOURCES

    if not _connected():
        console.print("no Ray cluster: no local head is running and RAY_ADDRESS is not set")
        raise typer.Exit(1)
    placed = workers_by_node()
    table = Table(title=f"Ray cluster at {ray.get_runtime_context().gcs_address}")
    for col in ("node", "address", "role", "state", "CPU free/total", "resources", "pool workers"):
        table.add_column(col)
    from ray._private.state import available_resources_per_node  # no public per-node call

    free = available_resources_per_node()
    for n in ray.nodes():
        node_id, total = n["NodeID"], n["Resources"]
        avail = free.get(node_id, {})
        custom = {
            k: v
            for k, v in total.items()
            if k not in RAY_BUILTIN_RESOURCES and not k.startswith(("node:", "accelerator_type"))
        }
        table.add_row(
            node_id[:12],
            n["NodeManagerAddress"],
            "head" if "node:__internal_head__" in total else "worker",
            "alive" if n["Alive"] else Text("dead", "red"),
            f"{avail.get('CPU', 0):g}/{total.get('CPU', 0):g}" if n["Alive"] else "-",
            ", ".join(f"{k}={v:g}" for k, v in sorted(custom.items())) or "-",
            ", ".join(placed.get(node_id, [])) or "-",
        )
    console.print(table)
    console.print(heads_line())


@cluster_app.command("up")
def up(num_cpus: Annotated[int, typer.Option(help="CPUs the head offers")] = 16) -> None:
    """Start the local Ray head (127.0.0.1) if none is running."""
    from hybrid_engine.pool.cluster import local_head

    try:
        console.print(f"local head at {local_head(start=True, num_cpus=num_cpus)}")
    except Exception as e:
        fail(e)


@cluster_app.command("add-node")
def add_node(
    name: Annotated[str, typer.Argument(help="a name for the node (its state file)")],
    num_cpus: Annotated[int, typer.Option(help="CPUs the node offers")] = 1,
    resources: Annotated[str, typer.Option(help='custom resources, JSON: {"trainer": 1}')] = "{}",
) -> None:
    """Add a node to the local head's cluster: its own raylet on this machine."""
    from hybrid_engine.pool.cluster import add_local_node

    try:
        extra = json.loads(resources)
        if not isinstance(extra, dict):
            raise ValueError(f"--resources {resources!r}: a JSON object, e.g. '{{\"trainer\": 1}}'")
        info = add_local_node(name, num_cpus, extra)
    except json.JSONDecodeError as e:
        fail(ValueError(f"--resources {resources!r} is not JSON: {e.msg}"))
    except Exception as e:
        fail(e)
    console.print(f"node {name!r} joined: {info['num_cpus']} CPU(s), resources {info['resources']}")


@cluster_app.command("remove-node")
def remove_node(
    name: str,
    kill: Annotated[bool, typer.Option(help="SIGKILL, as a lost machine")] = False,
) -> None:
    """Stop a node `add-node` started, with the pool workers on it."""
    from hybrid_engine.pool.cluster import remove_local_node

    if not remove_local_node(name, kill=kill):
        fail(ValueError(f"no local node named {name!r}"))
    console.print(f"node {name!r} stopped")


@cluster_app.command("down")
def down() -> None:
    """Stop every local head this machine's state dir started and every node added to them
    (the pools on them die with them)."""
    from hybrid_engine.pool.cluster import stop_local_head

    console.print("local cluster stopped" if stop_local_head() else "no local head is running")


pool_app = typer.Typer(help="The persistent Ray worker pool.")
PoolName = Annotated[str, typer.Option("--pool", help="ray.pool_name of the pool")]


def _checked_pool(pool: str) -> str:
    """`--pool` checked like `ray.pool_name` (one line and exit 1 when it is not a name)."""
    from pydantic import ValidationError

    from hybrid_engine.config import RayConfig

    try:
        RayConfig(pool_name=pool)
    except ValidationError:
        fail(
            ValueError(
                f"--pool {pool!r} is not a pool name (letters, digits, _ . -; "
                "starting with a letter or digit; at most 63 characters)"
            )
        )
    return pool


@pool_app.command("status")
def pool_status(pool: PoolName = "default") -> None:
    """Each worker: weights version, role, rank, pid, RSS, health."""
    pool = _checked_pool(pool)  # before Ray and torch are imported: a bad name fails at once
    from rich.table import Table

    from flows.cli.sharing import show_pool
    from hybrid_engine.pool.pool import pool_status as status

    if not _connected():
        console.print("no Ray cluster: no local head is running and RAY_ADDRESS is not set")
        raise typer.Exit(1)
    workers = status(pool)
    if not workers:
        console.print(f"pool {pool!r} has no workers")
        raise typer.Exit(1)
    table = Table(title=f"pool {pool!r}")
    for col in ("worker", "roles", "rank", "pid", "weights", "rss GB", "peak GB", "health"):
        table.add_column(col)
    for w in workers:
        healthy = w.get("healthy")
        table.add_row(
            w["name"],
            "+".join(w.get("roles", [])),
            f"{w.get('rank', '-')}/{w.get('world', '-')}",
            str(w.get("pid", "-")),
            str(w.get("weights_version", "-")),
            f"{w['rss_gb']:.2f}" if "rss_gb" in w else "-",
            f"{w['peak_rss_gb']:.2f}" if "peak_rss_gb" in w else "-",
            "ok" if healthy else Text(w.get("error") or "unhealthy", "red"),
        )
    show_pool(table, pool, workers)  # and the runs sharing it (ray.when_busy=share)
    console.print(heads_line())


@pool_app.command("down")
def pool_down(pool: PoolName = "default") -> None:
    """Kill the pool's workers; stop the local Ray head if no other pool uses it."""
    pool = _checked_pool(pool)
    from hybrid_engine.pool.pool import down

    if not _connected():
        console.print("no Ray cluster is running: nothing to stop")
        return
    from hybrid_engine.pool.claim import holder_line, live_holder

    if (h := live_holder(pool)) is not None:
        fail(RuntimeError(f"{holder_line(pool, h)}; stop that run first"))
    killed = down(pool)
    console.print(f"pool {pool!r}: stopped {len(killed)} worker(s) {killed}")
