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
and, when placed separately, `critic-*` and `rm-*`. Each group trains in FSDP2 over its own
torch.distributed world. A pool built for another model or layout is refused, not reused.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import time
from typing import Any

import psutil
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from hybrid_engine.batch import Batch
from hybrid_engine.config import HybridConfig, import_plugins
from hybrid_engine.dispatch import gather_rows, mean_metrics, split_for_update, split_rows
from hybrid_engine.models import load_tokenizer
from hybrid_engine.ray_cluster import (  # noqa: F401 - part of this module's interface
    PoolError,
    _free_port,
    _head_processes,
    connect,
    local_head,
    state_dir,
    stop_local_head,
)
from hybrid_engine.rollout import SamplingParams
from hybrid_engine.workers import REUSE_FREED_MEMORY_ENV, ActorRolloutRef, Critic, RewardModel


class WorkerDiedError(PoolError):
    """A worker process is gone; the message names it."""


# --------------------------------------------------------------------------- workers
def pool_spec(cfg: HybridConfig) -> dict[str, Any]:
    """What a worker is built from; a pool whose spec differs cannot serve `cfg`."""
    return {
        "model": cfg.model.model_dump(),
        "actor.layout": cfg.actor.layout.model_dump(),
        "actor.optim": cfg.actor.optim.model_dump(),
        "actor.lora": cfg.actor.lora.model_dump(),
        "critic": cfg.use_critic and {
            "model_path": cfg.critic.model_path, "optim": cfg.critic.optim.model_dump(),
            "placement": cfg.ray.critic, "dp": cfg.ray.critic_dp,
        },
        "reward_model": cfg.use_reward_model and {
            "model_path": cfg.reward.model_path, "placement": cfg.ray.reward_model,
            "dp": cfg.ray.reward_model_dp,
        },
        "reference": cfg.use_reference,
        "rollout.name": cfg.rollout.name,
        "trainer.seed": cfg.trainer.seed,
        "resources": [cfg.ray.num_cpus_per_rank, cfg.ray.num_gpus_per_rank],
    }  # fmt: skip


def group_plan(cfg: HybridConfig) -> dict[str, tuple[int, list[str]]]:
    """group name -> (ranks, roles hosted by each rank's process)."""
    actor_roles = ["actor"]
    plan: dict[str, tuple[int, list[str]]] = {}
    if cfg.use_critic:
        if cfg.ray.critic == "colocated":
            actor_roles.append("critic")
        else:
            plan["critic"] = (cfg.ray.critic_dp, ["critic"])
    if cfg.use_reward_model:
        if cfg.ray.reward_model == "colocated":
            actor_roles.append("rm")
        else:
            plan["rm"] = (cfg.ray.reward_model_dp, ["rm"])
    return {"actor": (cfg.actor.layout.dp, actor_roles), **plan}


class Worker:
    """One process of a group: hosts its roles on one rank. Runs as a detached Ray actor."""

    def __init__(self, cfg: HybridConfig, group: str, rank: int, world: int, roles: list[str]):
        self.cfg, self.group, self.rank, self.world = cfg, group, rank, world
        import_plugins(cfg.algorithm.plugins)  # the run's own losses, registered here too
        self.role_names = roles
        self.spec = pool_spec(cfg)
        self.roles: dict[str, Any] = {}
        self.error: str | None = None

    def address(self) -> str:
        """Rank 0 hosts the group's rendezvous."""
        return f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"

    def setup(self, init_method: str, threads: int) -> dict:
        from hybrid_engine.sharding import init_group

        torch.set_num_threads(threads)
        backend = "gloo"
        if self.cfg.device == "cuda":  # Ray exposes this worker's GPU as device 0
            torch.cuda.set_device(0)
            backend = "nccl"
        init_group(self.rank, self.world, init_method, self.cfg.ray.call_timeout_s, backend)
        self.build()
        return self.info()

    def build(self) -> None:
        """(Re)create the roles from the config: fresh weights, optimizer and version 0."""
        tokenizer = load_tokenizer(self.cfg.model)
        make = {"actor": ActorRolloutRef, "critic": Critic, "rm": RewardModel}
        self.roles = {}  # free the old models first
        self.roles = {r: make[r](self.cfg, tokenizer) for r in self.role_names}
        self.error = None

    def configure(self, cfg: HybridConfig) -> None:
        """Take a run's settings that do not change what the workers hold (batch sizes,
        clip ratios, sampling, ...); `pool_spec` guards the rest."""
        if pool_spec(cfg) != self.spec:
            raise PoolError("configure: the pool spec differs")
        import_plugins(cfg.algorithm.plugins)
        self.cfg = cfg
        for role in self.roles.values():
            role.configure(cfg)

    def call(self, role: str, method: str, *args: Any) -> Any:
        """A stage operation of one role. A failure marks the worker unhealthy: under FSDP
        its peers may be left mid-collective, so the group must be rebuilt."""
        try:
            return getattr(self.roles[role], method)(*args)
        except Exception as e:
            self.error = f"{role}.{method}: {type(e).__name__}: {e}"
            raise

    @ray.method(concurrency_group="status")
    def get_spec(self) -> dict:  # answers at once; `configure` then waits for a call in flight
        return self.spec

    @ray.method(concurrency_group="status")
    def rollout_progress(self, role: str) -> dict | None:  # answers while `generate` runs
        return self.roles[role].rollout_progress() if role in self.roles else None

    @ray.method(concurrency_group="status")
    def info(self) -> dict:
        mem = psutil.Process().memory_info().rss
        out = {
            "name": f"{self.group}-{self.rank}", "group": self.group, "rank": self.rank,
            "world": self.world, "roles": self.role_names, "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(), "rss_gb": mem / 1024**3,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
            "healthy": bool(self.roles) and self.error is None, "error": self.error,
        }  # fmt: skip
        for name, role in self.roles.items():
            out[name] = role.info()
        if "actor" in self.roles:
            out["weights_version"] = self.roles["actor"].weights_version
        return out


# `info` answers while a long stage call runs (its own thread); stage calls run one at a time.
RemoteWorker = ray.remote(max_restarts=0, concurrency_groups={"status": 1})(Worker)


# ---------------------------------------------------------------------- worker groups
class WorkerGroup:
    """The ranks of one group: call a method on all of them, split / gather the batch."""

    def __init__(self, cfg: HybridConfig, name: str, handles: list[Any]) -> None:
        self.cfg, self.name, self.handles = cfg, name, handles
        self.pool_name = cfg.ray.pool_name
        self.pids = [0] * len(handles)  # filled in once the workers answer

    @functools.cached_property
    def pad_token_id(self) -> int:
        """Fills token-id fields when ranks' results are gathered (read on first use)."""
        return load_tokenizer(self.cfg.model).pad_token_id

    @property
    def ranks(self) -> int:
        return len(self.handles)

    def wait(self, refs: list[Any], what: str, timeout_s: float | None = None) -> list[Any]:
        """Results in rank order; a dead worker or a timeout raises at once, naming it."""
        timeout_s = timeout_s or self.cfg.ray.call_timeout_s
        deadline = time.monotonic() + timeout_s
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(
                pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                names = ", ".join(f"{self.name}-{index[r]}" for r in pending)
                raise PoolError(
                    f"{what}: no answer from {names} within ray.call_timeout_s={timeout_s:g}s"
                )
            for ref in ready:
                i = index[ref]
                try:
                    results[i] = ray.get(ref)
                except RayActorError as e:
                    raise WorkerDiedError(
                        f"{what}: worker {self.name}-{i} (pid {self.pids[i]}) of pool "
                        f"{self.pool_name!r} died ({type(e).__name__}). Re-create the pool "
                        f"(`hybridrl pool down --pool {self.pool_name}`, then start again) and "
                        "restore the last saved state."
                    ) from None
        return results

    def call_all(self, role: str, method: str, *args: Any) -> list[Any]:
        refs = [h.call.remote(role, method, *args) for h in self.handles]
        return self.wait(refs, f"{role}.{method}")

    def call_split(self, role: str, method: str, batch: Batch, *args: Any) -> Batch:
        parts, pad = split_rows(batch, self.ranks)
        refs = [
            h.call.remote(role, method, p, *args) for h, p in zip(self.handles, parts, strict=True)
        ]
        return gather_rows(self.wait(refs, f"{role}.{method}"), pad, self.pad_token_id)

    def call_update(self, role: str, method: str, batch: Batch, mini_batch_size: int) -> dict:
        parts = split_for_update(batch, self.ranks, mini_batch_size)
        refs = [h.call.remote(role, method, p) for h, p in zip(self.handles, parts, strict=True)]
        return mean_metrics(self.wait(refs, f"{role}.{method}"))

    def info(self, timeout_s: float = 10.0) -> list[dict]:
        """Each rank's report; a dead or unresponsive one is reported, not raised."""
        out = []
        for i, h in enumerate(self.handles):
            try:
                out.append(ray.get(h.info.remote(), timeout=timeout_s))
            except (RayActorError, GetTimeoutError) as e:
                out.append({"name": f"{self.name}-{i}", "group": self.name, "rank": i,
                            "pid": self.pids[i], "healthy": False, "error": type(e).__name__})  # fmt: skip
        return out


class RoleProxy:
    """A role served by a group, with the same methods as the in-process role."""

    def __init__(self, group: WorkerGroup, role: str, cfg: HybridConfig) -> None:
        self.group, self.role, self.cfg = group, role, cfg

    # actor-rollout-ref
    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        return self.group.call_split(self.role, "generate", batch, sampling)

    def compute_log_prob(self, batch: Batch) -> Batch:
        return self.group.call_split(self.role, "compute_log_prob", _inputs(batch))

    def rollout_progress(self) -> dict[str, float] | None:
        """The generate call running now, over all ranks (None when none runs)."""
        refs = [h.rollout_progress.remote(self.role) for h in self.group.handles]
        try:
            parts = [p for p in ray.get(refs, timeout=5.0) if p]
        except (RayActorError, GetTimeoutError):
            return None
        if not parts:
            return None
        return {"tokens": sum(p["tokens"] for p in parts),
                "seconds": max(p["seconds"] for p in parts)}  # fmt: skip

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return self.group.call_split(self.role, "compute_ref_log_prob", _inputs(batch))

    def update_actor(self, batch: Batch) -> dict[str, float]:
        return self.group.call_update(
            self.role, "update_actor", _train(batch), self.cfg.actor.ppo_mini_batch_size
        )

    # critic
    def compute_values(self, batch: Batch) -> Batch:
        return self.group.call_split(self.role, "compute_values", _inputs(batch))

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self.group.call_update(
            self.role, "update_critic", _train(batch), self.cfg.critic.ppo_mini_batch_size
        )

    # reward model
    def score(self, batch: Batch) -> Batch:
        return self.group.call_split(self.role, "score", _inputs(batch))

    # state
    def save(self, url: str, storage_options: dict | None = None) -> dict[str, str]:
        """Every rank writes its part; {file name: sha256} of all of them."""
        parts = self.group.call_all(self.role, "save", url, storage_options)
        return {name: sha for part in parts for name, sha in part.items()}

    def load(
        self, url: str, storage_options: dict | None = None, expected: dict | None = None
    ) -> int:
        return self.group.call_all(self.role, "load", url, storage_options, expected)[0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.group.call_all(self.role, "full_state_dict")[0]

    def invalidate(self) -> None:
        self.group.call_all(self.role, "invalidate")

    @property
    def weights_version(self) -> int:
        """Rank 0's version (the ranks step together)."""
        ref = self.group.handles[0].info.remote()
        return self.group.wait([ref], "weights_version")[0]["weights_version"]

    @property
    def weights_run(self) -> str | None:
        """The run whose updates made the weights rank 0 holds (None = fresh)."""
        ref = self.group.handles[0].info.remote()
        return self.group.wait([ref], "weights_run")[0][self.role]["weights_run"]


INPUT_KEYS = ("input_ids", "attention_mask", "response_mask")
TRAIN_KEYS = INPUT_KEYS + (
    "advantages", "returns", "values", "old_log_probs", "ref_log_prob", "rollout_is_weights",
)  # fmt: skip


def _inputs(batch: Batch) -> Batch:
    """Only what a forward pass needs travels to the workers."""
    return batch.select(INPUT_KEYS, meta=False)


def _train(batch: Batch) -> Batch:
    return batch.select([k for k in TRAIN_KEYS if k in batch.tensors], meta=False)


# -------------------------------------------------------------------------- the pool
class Pool:
    """Named, detached workers for one config; found again by later drivers."""

    def __init__(self, cfg: HybridConfig, groups: dict[str, WorkerGroup]) -> None:
        self.cfg, self.groups, self.name = cfg, groups, cfg.ray.pool_name
        self.attach_seconds = 0.0
        self.created = False

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
        found = {w["name"] for w in ray.util.list_named_actors(all_namespaces=True)
                 if w["namespace"] == ns}  # fmt: skip
        if not found:
            return None
        wanted = {f"{g}-{r}" for g, (ranks, _) in plan.items() for r in range(ranks)}
        if found != wanted:
            raise PoolError(
                f"pool {name!r} has workers {sorted(found)} but this config needs "
                f"{sorted(wanted)}; tear it down with `hybridrl pool down --pool {name}` or set "
                "another ray.pool_name"
            )
        handles = {n: ray.get_actor(n, namespace=ns) for n in sorted(found)}
        try:
            spec = ray.get(handles["actor-0"].get_spec.remote(), timeout=30)
        except RayActorError:
            raise WorkerDiedError(
                f"worker actor-0 of pool {name!r} is dead; `hybridrl pool down --pool {name}`"
            ) from None
        want = pool_spec(cfg)
        if spec != want:
            diff = [k for k in want if spec.get(k) != want[k]]
            detail = "; ".join(
                f"{k}: pool has {spec.get(k)!r}, config asks {want[k]!r}" for k in diff
            )
            raise PoolError(
                f"pool {name!r} was built for another config ({detail}). Tear it down with "
                f"`hybridrl pool down --pool {name}` or set another ray.pool_name"
            )
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
                    f"`hybridrl pool down --pool {name}`, then start again"
                )
            g.wait([h.configure.remote(cfg) for h in g.handles], "configure")
        return pool

    @classmethod
    def create(cls, cfg: HybridConfig) -> Pool:
        ns, r = cls.namespace(cfg.ray.pool_name), cfg.ray
        plan = group_plan(cfg)
        processes = sum(ranks for ranks, _ in plan.values())
        threads = cfg.trainer.num_threads or max(1, (os.cpu_count() or 1) // processes)
        groups = {}
        for g, (ranks, roles) in plan.items():
            # a single rank keeps freed memory like the local backend (bench/memory.py, SmolLM2:
            # step 15.6 -> 14.7 s, +0.08 GB); FSDP ranks do not: it grew them 2.5 -> 4.3 GB
            reuse = cfg.trainer.reuse_freed_memory and ranks == 1
            env = {**REUSE_FREED_MEMORY_ENV, **r.worker_env} if reuse else r.worker_env
            handles = [
                RemoteWorker.options(
                    name=f"{g}-{rank}", namespace=ns, lifetime="detached",
                    num_cpus=r.num_cpus_per_rank, num_gpus=r.num_gpus_per_rank,
                    runtime_env={"env_vars": env},
                ).remote(cfg, g, rank, ranks, roles)
                for rank in range(ranks)
            ]  # fmt: skip
            groups[g] = WorkerGroup(cfg, g, handles)
        pool = cls(cfg, groups)
        try:
            for g in groups.values():
                init = g.wait([g.handles[0].address.remote()], "start", r.start_timeout_s)[0]
                refs = [h.setup.remote(init, threads) for h in g.handles]
                g.pids = [i["pid"] for i in g.wait(refs, "setup", r.start_timeout_s)]
        except BaseException:
            pool.down(stop_head=False)
            raise
        return pool

    def role(self, role: str) -> RoleProxy:
        group = "actor" if role in group_plan(self.cfg)["actor"][1] else role
        return RoleProxy(self.groups[group], role, self.cfg)

    def status(self) -> list[dict]:
        return [i for g in self.groups.values() for i in g.info()]

    def reset(self) -> None:
        """Fresh weights and optimizers in every worker (a new run on a warm pool)."""
        for g in self.groups.values():
            g.wait([h.build.remote() for h in g.handles], "reset", self.cfg.ray.start_timeout_s)

    def down(self, stop_head: bool = True) -> None:
        down(self.name, stop_head)


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
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == ns
    )


def down(pool_name: str, stop_head: bool = True) -> list[str]:
    """Kill the pool's workers; stop the local head too if no other pool is left on it."""
    ns = Pool.namespace(pool_name)
    killed = find_workers(pool_name)
    for n in killed:
        with contextlib.suppress(ValueError):  # already gone
            ray.kill(ray.get_actor(n, namespace=ns), no_restart=True)
    others = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if a["namespace"].startswith("hybridrl-") and a["namespace"] != ns]  # fmt: skip
    if stop_head and not others and not (os.environ.get("RAY_ADDRESS")):
        stop_local_head()
    return killed
