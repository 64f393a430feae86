"""A worker's slot per run sharing the pool (`ray.when_busy=share`): the run's roles (weights,
optimizer, reference, ...), its config and driver, and its RNG states (torch, Python's
`random`, numpy), parked while another run's stage holds the worker and swapped back in
at the start of its own turn, so each run computes exactly what it would alone.

The slots stay resident in the worker's memory (the roles are moved by reference: a switch
costs the RNG swap, not a copy); `ray.max_resident_gb` bounds them all together."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    if isinstance(obj, torch.optim.Optimizer):
        return [v for s in obj.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return []


def resident_bytes(roles: dict[str, Any]) -> int:
    """Bytes of the models and optimizer state the roles hold (each storage counted once;
    a sharded parameter by its local shard)."""
    seen: dict[tuple[str, int], int] = {}
    for role in roles.values():
        for value in vars(role).values():
            for t in _tensors(value):
                local = t.to_local() if hasattr(t, "to_local") else t
                storage = local.untyped_storage()
                seen[(str(local.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


@dataclass
class Slot:
    """A parked run: what `Worker` holds for it while another run's stage runs."""

    roles: dict[str, Any]
    cfg: Any
    driver: dict[str, Any] | None
    rng: dict[str, Any] = field(default_factory=capture_rng)
    nbytes: int = 0


class SlotsMixin:
    """`Worker`'s part for runs sharing the pool: the active run lives in `roles`, `cfg`,
    `driver` (as a single run's would); the others are parked in `slots` by owner."""

    slots: dict[str, Slot]
    roles: dict[str, Any]
    driver: dict[str, Any] | None
    nbytes: int

    @property
    def active_owner(self) -> str | None:
        return (self.driver or {}).get("owner")

    def _park(self) -> None:
        if self.active_owner is not None and self.roles:
            self.slots[self.active_owner] = Slot(
                self.roles, self.cfg, self.driver, nbytes=self.nbytes
            )
        self.roles, self.driver, self.nbytes = {}, None, 0

    def activate(self, owner: str, live: list[str] | None = None) -> float:
        """Swap run `owner`'s slot in (the active one parked); slots of runs not in `live`
        (detached: their drivers are gone) are dropped. The seconds it took."""
        import time

        start = time.perf_counter()
        if live is not None:
            for o in [o for o in self.slots if o not in live]:
                del self.slots[o]
            if self.active_owner is not None and self.active_owner not in live:
                self.roles, self.driver, self.nbytes = {}, None, 0
        if self.active_owner == owner:
            return time.perf_counter() - start
        if owner not in self.slots:
            from hybrid_engine.pool.claim import PoolTaken

            raise PoolTaken(
                f"pool {self.cfg.ray.pool_name!r}: worker {self.group}-{self.rank} holds no "
                "state for this run (it was dropped: its driver was detached from the pool)"
            )
        self._park()
        slot = self.slots.pop(owner)
        self.roles, self.cfg, self.driver, self.nbytes = (
            slot.roles,
            slot.cfg,
            slot.driver,
            slot.nbytes,
        )
        restore_rng(slot.rng)
        return time.perf_counter() - start

    def join(self, cfg: Any, driver: dict[str, Any], max_bytes: float) -> int:
        """Attach a run sharing the pool: build its roles in a slot of their own (its own
        seed, optimizer, LoRA, ...) or, when it has one, swap it in and take its settings.
        Refused (PoolError, one line) when all slots would pass `max_bytes`; its bytes."""
        from hybrid_engine.config import import_plugins
        from hybrid_engine.pool.cluster import PoolError

        owner = driver["owner"]
        self.sharing = True  # emptied by a run that leaves, it is still healthy
        if self.active_owner == owner or owner in self.slots:
            self.activate(owner)
            import_plugins(cfg.algorithm.plugins)
            self.cfg, self.driver = cfg, driver
            for role in self.roles.values():
                role.configure(cfg)
            return self.nbytes
        held = self.nbytes + sum(s.nbytes for s in self.slots.values())
        have = [s.nbytes for s in self.slots.values()] + ([self.nbytes] if self.roles else [])
        bound = f"ray.max_resident_gb={max_bytes / 1024**3:g}"
        if have and held + max(have) > max_bytes:  # runs of one model: about the same size
            raise PoolError(
                f"pool {cfg.ray.pool_name!r}: worker {self.group}-{self.rank} holds "
                f"{held / 1024**3:.3f} GB for {len(have)} run(s); one more (about "
                f"{max(have) / 1024**3:.3f} GB) would pass {bound}"
            )
        self._park()
        import_plugins(cfg.algorithm.plugins)
        self.cfg = cfg
        self.build(driver)
        if held + self.nbytes > max_bytes:
            size = self.nbytes
            self.roles, self.driver, self.nbytes = {}, None, 0
            raise PoolError(
                f"pool {cfg.ray.pool_name!r}: run {driver['run']}'s state ({size / 1024**3:.3f} "
                f"GB) beside {held / 1024**3:.3f} GB of other runs' in worker "
                f"{self.group}-{self.rank} would pass {bound}"
            )
        return self.nbytes

    def leave(self, owner: str) -> None:
        """A run detached: free its slot."""
        self.slots.pop(owner, None)
        if self.active_owner == owner:
            self.roles, self.driver, self.nbytes = {}, None, 0

    def runs_info(self) -> list[dict[str, Any]]:
        parked = [(s.driver or {}, s.nbytes, False) for s in self.slots.values()]
        active = [(self.driver or {}, self.nbytes, True)] if self.roles else []
        return [
            {"run": d.get("run"), "owner": d.get("owner"), "resident_gb": n / 1024**3, "active": a}
            for d, n, a in active + parked
        ]
