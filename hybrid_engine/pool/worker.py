"""One process of the pool: a detached Ray actor hosting its group's roles on one rank
(`Worker`), and what a pool is built from (`pool_spec`, `group_plan`)."""

from __future__ import annotations

import functools
import hashlib
import os
import resource
from pathlib import Path
from typing import Any

import psutil
import ray
import torch

from hybrid_engine.config import HybridConfig, import_plugins
from hybrid_engine.errors import EngineLostError
from hybrid_engine.models.loading import load_tokenizer, set_determinism
from hybrid_engine.pool.claim import PoolTaken, driver_line, taken
from hybrid_engine.pool.cluster import PoolError, free_port
from hybrid_engine.pool.placement import RESOURCES_KEY
from hybrid_engine.pool.replica import RolloutReplica
from hybrid_engine.pool.slots import Slot, SlotsMixin, resident_bytes
from hybrid_engine.roles.value_models import Critic, RewardModel
from hybrid_engine.roles.workers import ActorRolloutRef


@functools.cache
def code_digest() -> str:
    """12 hex digits naming the engine code this process runs: a pool started by other
    code (an older checkout, an edited file) is refused at attach instead of half-working."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha1()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def pool_spec(cfg: HybridConfig) -> dict[str, Any]:
    """What a worker is built from; a pool whose spec differs cannot serve `cfg`. The keys
    of `SHARED` come first: runs sharing a pool (`ray.when_busy=share`) must agree on them;
    the rest is each run's own, built in its slot of the workers (`pool.slots`)."""
    return {
        "code": code_digest(),
        "model": cfg.model.model_dump(),
        "actor.layout": cfg.actor.layout.model_dump(),
        "placement": cfg.ray.placement,
        "resources": [cfg.ray.num_cpus_per_rank, cfg.ray.num_gpus_per_rank],
        "custom_resources": {g: getattr(cfg.ray, k) for g, k in RESOURCES_KEY.items()},
        "rollout.name": cfg.rollout.name,
        "critic": cfg.use_critic
        and {
            "model_path": cfg.critic.model_path,
            "placement": cfg.ray.critic,
            "dp": cfg.ray.critic_dp,
        },
        "reward_model": cfg.use_reward_model
        and {
            "model_path": cfg.reward.model_path,
            "placement": cfg.ray.reward_model,
            "dp": cfg.ray.reward_model_dp,
        },
        "rollout_group": cfg.separate_rollout and {"dp": cfg.ray.rollout_dp},
        # each run's own
        "actor.optim": optim_spec(cfg, cfg.actor),
        "actor.lora": cfg.actor.lora.model_dump(),
        "critic.optim": cfg.use_critic and optim_spec(cfg, cfg.critic),
        "reference": cfg.use_reference,
        "trainer.seed": cfg.trainer.seed,
    }


def optim_spec(cfg: HybridConfig, role: Any) -> dict[str, Any]:
    """A role's optimizer settings, and the length of its schedule where the LR decays (the
    workers' schedulers are built with it)."""
    out = role.optim.model_dump()
    if role.optim.lr_schedule != "constant":
        out["total_steps"] = cfg.optimizer_steps(role)
    return out


SHARED = (
    "code",
    "model",
    "actor.layout",
    "placement",
    "resources",
    "custom_resources",
    "rollout.name",
    "critic",
    "reward_model",
    "rollout_group",
)


def shared_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The part of a pool spec that runs sharing the pool must agree on."""
    return {k: spec.get(k) for k in SHARED}


def spec_diff(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """The keys of `want` whose values `have` does not share, in `pool_spec`'s order."""
    return [k for k in want if have.get(k) != want[k]]


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
    if cfg.separate_rollout:
        plan["rollout"] = (cfg.ray.rollout_dp, ["rollout"])
    return {"actor": (cfg.actor.layout.dp, actor_roles), **plan}


class Worker(SlotsMixin):
    """One process of a group: hosts its roles on one rank. Runs as a detached Ray actor.
    Runs sharing the pool each have a slot of their own here (`pool.slots`)."""

    def __init__(self, cfg: HybridConfig, group: str, rank: int, world: int, roles: list[str]):
        self.cfg, self.group, self.rank, self.world = cfg, group, rank, world
        import_plugins(cfg.algorithm.plugins)  # the run's own losses, registered here too
        self.role_names = roles
        self.spec = pool_spec(cfg)
        self.sharing = cfg.ray.when_busy == "share"  # a run that leaves leaves it empty
        self.roles: dict[str, Any] = {}
        self.error: str | None = None
        self.driver: dict[str, Any] | None = None  # who set it up or configured it last
        self.slots: dict[str, Slot] = {}  # runs sharing the pool, parked (by owner)
        self.nbytes = 0  # resident bytes of the active run's roles
        self.engines: dict[str, Any] = {}  # rollout engines (vllm) by settings: for every slot

    def address(self) -> str:
        """Rank 0 hosts the group's rendezvous, on its node's address (not the driver's)."""
        ip = ray.util.get_node_ip_address()
        return f"tcp://{ip}:{free_port(ip)}"

    def setup(self, init_method: str, threads: int, driver: dict | None = None) -> dict:
        from hybrid_engine.models.sharding import init_group

        torch.set_num_threads(threads)
        set_determinism(self.cfg.trainer.deterministic, self.cfg.device)
        backend = "gloo"
        if self.cfg.device == "cuda":  # Ray exposes this worker's GPU as device 0
            torch.cuda.set_device(0)
            backend = "nccl"
        init_group(self.rank, self.world, init_method, self.cfg.ray.call_timeout_s, backend)
        self.build(driver)
        return self.info()

    def build(self, driver: dict | None = None) -> None:
        """(Re)create the roles from the config: fresh weights, optimizer and version 0."""
        self.driver = driver
        tokenizer = load_tokenizer(self.cfg.model)
        make = {
            "actor": lambda cfg, tok: ActorRolloutRef(cfg, tok, self.engines),
            "critic": Critic,
            "rm": RewardModel,
            "rollout": lambda cfg, tok: RolloutReplica(cfg, tok, self.engines),
        }
        self.roles = {}  # free the old models first
        self.roles = {r: make[r](self.cfg, tokenizer) for r in self.role_names}
        self.nbytes = resident_bytes(self.roles)
        self.error = None

    def configure(self, cfg: HybridConfig, driver: dict | None = None) -> None:
        """Take a run's settings that do not change what the workers hold (batch sizes,
        clip ratios, sampling, ...); `pool_spec` guards the rest."""
        if pool_spec(cfg) != self.spec:
            raise PoolError("configure: the pool spec differs")
        for owner in list(self.slots):  # a run alone on the pool: runs that shared it are gone
            self.drop(owner)
        self.driver = driver
        import_plugins(cfg.algorithm.plugins)
        self.cfg = cfg
        if not self.roles:  # the last run sharing the pool left it empty
            self.build(driver)
        for role in self.roles.values():
            role.configure(cfg)

    def check_driver(self, driver: dict | None) -> None:
        """PoolTaken when another driver configured this worker after `driver` did (a
        caller without an id, an older client, is not checked)."""
        if driver is None or (self.driver or {}).get("owner") == driver["owner"]:
            return
        if driver["owner"] in self.slots:
            raise PoolTaken(
                f"pool {self.cfg.ray.pool_name!r}: worker {self.group}-{self.rank} holds "
                f"{driver_line(self.driver)}'s state now: run {driver['run']} called it "
                "outside its turn"
            )
        raise taken(self.cfg.ray.pool_name, f"{self.group}-{self.rank}", self.driver, driver["run"])

    def call(self, role: str, method: str, *args: Any, driver: dict | None = None) -> Any:
        """A stage operation of one role, for `driver` (see `check_driver`). A failure marks
        the worker unhealthy: under FSDP its peers may be left mid-collective, so the group
        must be rebuilt."""
        self.check_driver(driver)
        if role not in self.roles:  # being rebuilt by an older client
            raise PoolTaken(
                f"pool {self.cfg.ray.pool_name!r}: worker {self.group}-{self.rank} holds no "
                f"{role!r} now (roles {sorted(self.roles)}): another driver is rebuilding it"
            )
        try:
            return getattr(self.roles[role], method)(*args)
        except EngineLostError:
            raise  # its engine was replaced: the worker is sound, the stage retries
        except Exception as e:
            self.error = f"{role}.{method}: {type(e).__name__}: {e}"
            raise

    def publish(self, role: str, driver: dict | None = None) -> list | None:
        """The weights a rollout replica loads (full, or LoRA's adapters) into Ray's object
        store (all ranks gather, rank 0 puts): `[ref]` from rank 0 (a list, so that the
        caller does not fetch the tensors)."""
        state = self.call(role, "replica_state_dict", driver=driver)
        return [ray.put(state)] if self.rank == 0 else None

    def receive(self, role: str, holder: list, version: int, driver: dict | None = None) -> float:
        """Load the weights `publish` put (`holder = [ref]`) into the role; the seconds."""
        return self.call(role, "receive", ray.get(holder[0]), version, driver=driver)

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
            "name": f"{self.group}-{self.rank}",
            "group": self.group,
            "rank": self.rank,
            "world": self.world,
            "roles": self.role_names,
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "rss_gb": mem / 1024**3,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
            "healthy": (bool(self.roles) or bool(self.slots) or self.sharing)
            and self.error is None,
            "error": self.error,
            "driver": self.driver,
            "runs": self.runs_info(),
        }
        for name, role in self.roles.items():
            out[name] = role.info()
        for role in ("actor", "rollout"):  # a rollout replica: the version it generates with
            if role in self.roles:
                out["weights_version"] = self.roles[role].weights_version
        return out


# `info` answers while a long stage call runs (its own thread); stage calls run one at a time.
RemoteWorker = ray.remote(max_restarts=0, concurrency_groups={"status": 1})(Worker)
