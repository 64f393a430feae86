"""Where the pool's ranks run: one Ray placement group per worker group, and the cluster's
nodes as `hybridrl cluster status` shows them.

A group's placement group holds one bundle per rank, `{CPU: ray.num_cpus_per_rank,
GPU: ray.num_gpus_per_rank, **ray.<group>_resources}`, placed by `ray.placement` (pack,
spread or strict_spread). Rank r runs in bundle r, so the ranks sit where the bundles were
reserved. The placement groups are detached and named `<pool>-<group>` like the workers, so
the pool's reservation outlives the driver that made it; `remove` releases them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybrid_engine.config import HybridConfig
from hybrid_engine.pool.cluster import PoolError

STRATEGY = {"pack": "PACK", "spread": "SPREAD", "strict_spread": "STRICT_SPREAD"}
RESOURCES_KEY = {  # every group a pool can have -> the ray.* key naming its custom resources
    "actor": "actor_resources",
    "critic": "critic_resources",
    "rm": "reward_model_resources",
    "rollout": "rollout_resources",
}


def bundle(cfg: HybridConfig, group: str) -> dict[str, float]:
    """What one rank of `group` reserves."""
    r = cfg.ray
    out = {"CPU": r.num_cpus_per_rank, **getattr(r, RESOURCES_KEY[group])}
    if r.num_gpus_per_rank:
        out["GPU"] = r.num_gpus_per_rank
    return out


def pg_name(pool_name: str, group: str) -> str:
    return f"{pool_name}-{group}"


def reserve(cfg: HybridConfig, group: str, ranks: int, timeout_s: float) -> PlacementGroup:
    """The group's placement group, created and ready. Refused at once (PoolError, one line
    saying what is missing) when the alive nodes could never hold it; when they could but
    their free resources do not within `timeout_s`, it is removed and that is said."""
    name = pg_name(cfg.ray.pool_name, group)
    with contextlib.suppress(ValueError):  # one left by a pool torn down half-way
        remove_placement_group(get_placement_group(name))
    want = bundle(cfg, group)
    where = (
        f"pool {cfg.ray.pool_name!r}: group {group} needs {ranks} x {want} "
        f"(ray.placement={cfg.ray.placement})"
    )
    nodes = alive_nodes()
    why = never_fits(cfg.ray.placement, ranks, want, nodes)
    if why:
        raise _unplaceable(where, why, nodes)
    pg = placement_group(
        [dict(want) for _ in range(ranks)],
        strategy=STRATEGY[cfg.ray.placement],
        name=name,
        lifetime="detached",
    )
    # While it waits, the nodes are looked at again every second: a node lost just before
    # (Ray marks it dead only after missed health checks) makes it unplaceable later.
    ready, deadline = pg.ready(), time.monotonic() + timeout_s
    while not ray.wait([ready], timeout=min(1.0, max(deadline - time.monotonic(), 0)))[0]:
        nodes = alive_nodes()
        why = never_fits(cfg.ray.placement, ranks, want, nodes)
        if why or time.monotonic() >= deadline:
            remove_placement_group(pg)
            if why:
                raise _unplaceable(where, why, nodes)
            raise PoolError(
                f"{where}: the nodes could hold it but their free resources did "
                f"not within ray.start_timeout_s={timeout_s:g} s (other pools or "
                "tasks use them; `hybridrl cluster status`)"
            )
    return pg


def _unplaceable(where: str, why: str, nodes: list[dict[str, Any]]) -> PoolError:
    return PoolError(f"{where} but {why} ({len(nodes)} alive node(s); `hybridrl cluster status`)")


def never_fits(
    placement: str, ranks: int, want: dict[str, float], nodes: list[dict[str, Any]]
) -> str | None:
    """Why `ranks` bundles of `want` cannot be placed on these nodes even when they are idle
    (None if they can)."""
    missing = [k for k in want if not any(n["resources"].get(k, 0) >= want[k] for n in nodes)]
    if missing:
        return f"no alive node has {', '.join(f'{k}={want[k]:g}' for k in missing)}"
    per_node = [min(int(n["resources"].get(k, 0) // v) for k, v in want.items()) for n in nodes]
    if placement == "strict_spread" and sum(c > 0 for c in per_node) < ranks:
        return f"strict_spread needs {ranks} nodes that each fit one; {sum(c > 0 for c in per_node)} do"
    if sum(per_node) < ranks:
        return f"the alive nodes fit {sum(per_node)} of them"
    return None


def strategy(pg: PlacementGroup, rank: int) -> PlacementGroupSchedulingStrategy:
    """Run a rank in its bundle."""
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank)


def release(pool_name: str, groups: list[str]) -> None:
    """Remove the pool's placement groups (those that exist)."""
    for group in groups:
        with contextlib.suppress(ValueError):
            remove_placement_group(get_placement_group(pg_name(pool_name, group)))


def alive_nodes() -> list[dict[str, Any]]:
    """The cluster's alive nodes: id, address, whether head, total resources."""
    out = []
    for n in ray.nodes():
        if n.get("Alive"):
            out.append(
                {
                    "node_id": n["NodeID"],
                    "address": n["NodeManagerAddress"],
                    "head": "node:__internal_head__" in n["Resources"],
                    "resources": {
                        k: v for k, v in n["Resources"].items() if not k.startswith("node:")
                    },
                }
            )
    return out
