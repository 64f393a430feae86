"""The persistent worker pool: named, detached Ray actors that outlive any driver.

    pool = Pool.up(cfg)                 # connect (or start a local head), attach or create
    actor = pool.role("actor")          # a proxy: actor.generate(batch, sampling) etc.
    pool.status(); pool.down()

Connection: `ray.address` or `$RAY_ADDRESS` names an existing cluster. Otherwise the pool
starts a local head as its own background process (`ray start --head` on 127.0.0.1) and
records its address in `<state dir>/head.json`, so the head and the actors on it survive the
driver; the next driver finds them again. The state dir is `$HYBRIDRL_RAY_STATE`, default
`~/.cache/hybridrl/ray`.

Workers live in the Ray namespace `hybridrl-<pool_name>`, named `<group>-<rank>`: the actor
group (`actor-0..dp-1`, hosting actor+rollout+ref and any colocated critic / reward model)
and, when placed separately, `critic-*`, `rm-*` and `rollout-*` (generation replicas fed
the trainer's weights, `hybrid_engine.pool.replica`). Each group trains in FSDP2 over its own
torch.distributed world. A pool built for another model or layout is refused, not reused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator

import psutil
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from hybrid_engine.config import HybridConfig
from hybrid_engine.pool import placement
from hybrid_engine.pool.claim import NAME as CLAIM
from hybrid_engine.pool.claim import PoolClaim
from hybrid_engine.pool.cluster import (  # noqa: F401 - part of this module's interface
    PoolError,
    connect,
    free_port,
    head_processes,
    local_head,
    state_dir,
    stop_local_head,
)
from hybrid_engine.pool.group import StageLimit, WorkerDiedError, WorkerGroup, WorkerHungError
from hybrid_engine.pool.proxy import RoleProxy
from hybrid_engine.pool.worker import RemoteWorker, group_plan, pool_spec, shared_spec, spec_diff
from hybrid_engine.roles.workers import REUSE_FREED_MEMORY_ENV


# -------------------------------------------------------------------------- the pool
class Pool:
    """Named, detached workers for one config; found again by later drivers."""

    def __init__(self, cfg: HybridConfig, groups: dict[str, WorkerGroup]) -> None:
        self.cfg, self.groups, self.name = cfg, groups, cfg.ray.pool_name
        self.attach_seconds = 0.0
        self.created = False
        self.claim: PoolClaim | None = None
        self.limit = StageLimit(cfg.ray.call_timeout_s, "ray.call_timeout_s")
        for g in groups.values():
            g.limit = self.limit

    @contextlib.contextmanager
    def time_limit(self, seconds: float, why: str) -> Iterator[None]:
        """Calls made in the block that take longer than `seconds` raise WorkerHungError."""
        before = self.limit.seconds, self.limit.why
        self.limit.seconds, self.limit.why = seconds, why
        try:
            yield
        finally:
            self.limit.seconds, self.limit.why = before

    @staticmethod
    def namespace(name: str) -> str:
        return f"hybridrl-{name}"

    @classmethod
    def up(cls, cfg: HybridConfig) -> Pool:
        """Attach to the pool named `ray.pool_name` (refused if built for another config), or
        create it."""
        connect(cfg)
        start = time.perf_counter()
        pool = cls.attach(cfg)
        if pool is None:
            pool = cls.create(cfg)
            pool.created = True
        pool.attach_seconds = time.perf_counter() - start
        return pool

    @classmethod
    def attach(cls, cfg: HybridConfig) -> Pool | None:
        """The running pool, or None if it has no workers; a partial or mismatched pool raises."""
        ns, name = cls.namespace(cfg.ray.pool_name), cfg.ray.pool_name
        plan = group_plan(cfg)
        found = set(find_workers(name))
        if not found:
            return None
        wanted = {f"{g}-{r}" for g, (ranks, _) in plan.items() for r in range(ranks)}
        share = cfg.ray.when_busy == "share"
        partial = PoolError(
            f"pool {name!r} has workers {sorted(found)} but this config needs "
            f"{sorted(wanted)}; tear it down with `hybridrl pool down --pool {name}` or set "
            "another ray.pool_name"
        )
        if found != wanted and not (share and "actor-0" in found):  # shared: the field first
            raise partial
        handles = {n: ray.get_actor(n, namespace=ns) for n in sorted(found)}
        try:
            spec = ray.get(handles["actor-0"].get_spec.remote(), timeout=30)
        except RayActorError:
            raise WorkerDiedError(
                f"worker actor-0 of pool {name!r} is dead; `hybridrl pool down --pool {name}`",
                "actor-0",
                "died",
            ) from None
        except GetTimeoutError:
            raise WorkerHungError(
                f"worker actor-0 of pool {name!r} does not answer within 30 s; "
                f"`hybridrl pool down --pool {name}`",
                "actor-0",
                "hung",
            ) from None
        want = pool_spec(cfg)
        if share:  # runs sharing the pool agree on its must-match part; the rest is their own
            spec, want = shared_spec(spec), shared_spec(want)
        if spec.get("code") != want["code"]:
            raise PoolError(
                f"pool {name!r} was started by other hybridrl code (pool runs "
                f"{spec.get('code') or 'a version without a code digest'}, this is "
                f"{want['code']}): `hybridrl pool down --pool {name}` and start again"
            )
        if diff := spec_diff(spec, want):
            k, more = diff[0], f"; also {', '.join(diff[1:])}" if diff[1:] else ""
            raise PoolError(
                f"pool {name!r} was built for another config: {k} differs (pool has "
                f"{spec.get(k)!r}, config asks {want[k]!r}{more}). Tear it down with "
                f"`hybridrl pool down --pool {name}` or set another ray.pool_name"
            )
        if found != wanted:
            raise partial
        groups = {}
        for g, (ranks, _) in plan.items():
            hs = [handles[f"{g}-{r}"] for r in range(ranks)]
            groups[g] = WorkerGroup(cfg, g, hs)
        pool = cls(cfg, groups)
        for g in groups.values():
            infos = g.info()
            g.pids = [i["pid"] for i in infos]
            dead = [i["name"] for i in infos if not i["healthy"]]
            if dead:
                raise WorkerDiedError(
                    f"pool {name!r}: worker(s) {dead} are dead or unhealthy; "
                    f"`hybridrl pool down --pool {name}`, then start again",
                    dead[0],
                    "died",
                )
            if share:
                join(g, cfg)
            else:
                g.wait([h.configure.remote(cfg, g.driver) for h in g.handles], "configure")
        return pool

    @classmethod
    def create(cls, cfg: HybridConfig) -> Pool:
        ns, r = cls.namespace(cfg.ray.pool_name), cfg.ray
        plan = group_plan(cfg)
        processes = sum(ranks for ranks, _ in plan.values())
        threads = cfg.trainer.num_threads or max(1, (os.cpu_count() or 1) // processes)
        groups, pgs = {}, {}
        try:  # each group's ranks reserved first: a pool that cannot be placed is said so
            for g, (ranks, _) in plan.items():
                pgs[g] = placement.reserve(cfg, g, ranks, r.start_timeout_s)
        except BaseException:
            placement.release(cfg.ray.pool_name, list(plan))
            raise
        for g, (ranks, roles) in plan.items():
            # a single rank keeps freed memory like the local backend (bench/memory.py, SmolLM2:
            # step 15.6 -> 14.7 s, +0.08 GB); FSDP ranks do not: it grew them 2.5 -> 4.3 GB
            reuse = cfg.trainer.reuse_freed_memory and ranks == 1
            env = {**REUSE_FREED_MEMORY_ENV, **r.worker_env} if reuse else r.worker_env
            handles = [
                RemoteWorker.options(
                    name=f"{g}-{rank}",
                    namespace=ns,
                    lifetime="detached",
                    num_cpus=r.num_cpus_per_rank,
                    num_gpus=r.num_gpus_per_rank,
                    runtime_env={"env_vars": env},
                    scheduling_strategy=placement.strategy(pgs[g], rank),
                ).remote(cfg, g, rank, ranks, roles)
                for rank in range(ranks)
            ]
            groups[g] = WorkerGroup(cfg, g, handles)
        pool = cls(cfg, groups)
        try:
            for g in groups.values():
                init = g.wait([g.handles[0].address.remote()], "start", r.start_timeout_s)[0]
                refs = [h.setup.remote(init, threads, g.driver) for h in g.handles]
                g.pids = [i["pid"] for i in g.wait(refs, "setup", r.start_timeout_s)]
                if r.when_busy == "share":  # the first run's slot, within ray.max_resident_gb
                    join(g, cfg)
        except BaseException:
            pool.down(stop_head=False)
            raise
        return pool

    def role(self, role: str) -> RoleProxy:
        group = "actor" if role in group_plan(self.cfg)["actor"][1] else role
        return RoleProxy(self.groups[group], role, self.cfg)

    def status(self) -> list[dict]:
        return [i for g in self.groups.values() for i in g.info()]

    def memory_metrics(self, stage: str) -> dict[str, float]:
        """Each worker's resident and peak memory, as `hybridrl pool status` shows it;
        `WorkerDiedError` naming `stage` for a worker that died since its last call."""
        metrics = {}
        for w in self.status():
            if "rss_gb" not in w:
                raise WorkerDiedError(
                    f"{stage}: worker {w['name']} of pool {self.name!r} died ({w.get('error')})",
                    w["name"],
                    "died",
                )
            metrics[f"perf/{w['name']}/rss_gb"] = w["rss_gb"]
            metrics[f"perf/{w['name']}/peak_rss_gb"] = w["peak_rss_gb"]
        return metrics

    def nodes(self) -> set[str]:
        """The Ray nodes that touch a run's storage: the workers' (checkpoints) and this
        driver's (stage state)."""
        workers = {i["node_id"] for i in self.status() if i.get("node_id")}
        return workers | {ray.get_runtime_context().get_node_id()}

    def reset(self) -> None:
        """Fresh weights and optimizers in every worker (a new run on a warm pool; on a
        shared pool, this run's slot only)."""
        with self.turn("reset"):
            for g in self.groups.values():
                refs = [h.build.remote(g.driver) for h in g.handles]
                g.wait(refs, "reset", self.cfg.ray.start_timeout_s)

    def turn(self, label: str) -> contextlib.AbstractContextManager[None]:
        """This run's turn on a shared pool (`hybrid_engine.pool.sharing`); a run alone
        holds the pool all along."""
        return self.claim.turn(label) if self.claim is not None else contextlib.nullcontext()

    def down(self, stop_head: bool = True, keep_claim: bool = True) -> None:
        down(self.name, stop_head, keep_claim)

    def hold(self, claim: PoolClaim | None) -> None:
        """The claim the driver holds: every call checks it was not taken (`PoolTaken`)."""
        self.claim = claim
        for g in self.groups.values():
            g.claim = claim
        if hasattr(claim, "bind"):  # a shared pool: its workers swap this run's slot in
            claim.bind(list(self.groups.values()))

    def teardown(self) -> list[str]:
        """Remove a broken pool so the same spec can be created again: its worker processes
        on this machine are killed outright (a stopped one cannot act on Ray's kill), then
        every named worker is killed and its name released. The head stays up."""
        for g in self.groups.values():
            for pid in g.pids:
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(pid)
                    if proc.name().startswith("ray::") or "ray" in " ".join(proc.cmdline()[:2]):
                        proc.kill()
        return down(self.name, stop_head=False, keep_claim=True)


def join(group: WorkerGroup, cfg: HybridConfig) -> None:
    """A run sharing the pool gets its slot in each worker of `group` (`pool.slots`)."""
    group.wait([h.join.remote(cfg, group.driver) for h in group.handles], "join")


def pool_status(pool_name: str) -> list[dict]:
    """Every worker's report (a dead one as unhealthy), without a config."""
    ns = Pool.namespace(pool_name)
    out = []
    for n in find_workers(pool_name):
        try:
            out.append(ray.get(ray.get_actor(n, namespace=ns).info.remote(), timeout=10))
        except (RayActorError, GetTimeoutError, ValueError) as e:
            out.append({"name": n, "healthy": False, "error": type(e).__name__})
    return out


def find_workers(pool_name: str) -> list[str]:
    ns = Pool.namespace(pool_name)
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == ns and a["name"] != CLAIM
    )


def down(pool_name: str, stop_head: bool = True, keep_claim: bool = False) -> list[str]:
    """Kill the pool's workers (and its claim, unless `keep_claim`: a run re-creating its
    pool); stop the local head too if no other pool is left on it."""
    ns = Pool.namespace(pool_name)
    killed = find_workers(pool_name)
    for n in killed + ([] if keep_claim else [CLAIM]):
        with contextlib.suppress(ValueError):  # already gone
            ray.kill(ray.get_actor(n, namespace=ns), no_restart=True)
    deadline = time.monotonic() + 30
    while find_workers(pool_name) and time.monotonic() < deadline:  # names are released
        time.sleep(0.1)
    placement.release(pool_name, list(placement.RESOURCES_KEY))  # every group a pool can have
    shutil.rmtree(state_dir() / "offload" / pool_name, ignore_errors=True)  # runs' parked state
    others = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"].startswith("hybridrl-") and a["namespace"] != ns
    ]
    if stop_head and not others and not (os.environ.get("RAY_ADDRESS")):
        stop_local_head()
    return killed
