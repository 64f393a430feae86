"""A worker's slot per run sharing the pool (`ray.when_busy=share`): the run's roles (weights,
optimizer, reference, ...), its config and driver, and its RNG states (torch, Python's
`random`, numpy), parked while another run's stage holds the worker and swapped back in
at the start of its own turn, so each run computes exactly what it would alone.

A parked slot stays resident in the worker's memory while the slots fit
`ray.max_resident_gb` together (a switch then moves references and RNG states, not weights).
Past it, the slots parked longest are offloaded: the bytes of their models' and optimizers'
storages go to a file on the worker's disk (`state_dir()/offload/<pool>/<worker>/`) and the
storages are freed; at the run's next turn the same bytes come back into the same storages,
so the run computes exactly what it would alone, and the switch costs the write and the
read."""

from __future__ import annotations

import hashlib
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
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


def _storages(roles: dict[str, Any]) -> list[torch.UntypedStorage]:
    """The storages of the models and optimizer state the roles hold, each once (a sharded
    parameter by its local shard)."""
    seen: dict[tuple[str, int], torch.UntypedStorage] = {}
    for role in roles.values():
        for value in vars(role).values():
            for t in _tensors(value):
                local = t.to_local() if hasattr(t, "to_local") else t
                storage = local.untyped_storage()
                if storage.nbytes():
                    seen[(str(local.device), storage.data_ptr())] = storage
    return list(seen.values())


def resident_bytes(roles: dict[str, Any]) -> int:
    """Bytes of the models and optimizer state the roles hold."""
    return sum(s.nbytes() for s in _storages(roles))


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def offload(roles: dict[str, Any], path: Path) -> list[tuple[torch.UntypedStorage, int]]:
    """Write the bytes of the roles' storages to `path`, then free the storages; returns them
    with their sizes, for `restore`. Nothing is freed when the write fails (the file is
    removed): the slot stays resident."""
    held = [(s, s.nbytes()) for s in _storages(roles)]
    need = sum(n for _, n in held)
    path.parent.mkdir(parents=True, exist_ok=True)
    if need > (free := shutil.disk_usage(path.parent).free):
        raise OSError(f"{need / 1024**3:.3f} GB to offload to {path.parent}, {free} bytes free")
    try:
        with path.open("wb") as f:
            for s, _ in held:
                # a copy: numpy's view would leave the storage not resizable
                f.write(_as_bytes(s).to("cpu", copy=True).numpy().data)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    for s, _ in held:
        s.resize_(0)
    return held


def restore(held: list[tuple[torch.UntypedStorage, int]], path: Path) -> None:
    """Bring back what `offload` wrote to `path` into the same storages; removes the file."""
    with path.open("rb") as f:
        for s, n in held:
            s.resize_(n)
            buf = torch.empty(n, dtype=torch.uint8)
            if f.readinto(buf.numpy().data) != n:
                raise OSError(f"{path} is shorter than the state offloaded to it")
            _as_bytes(s).copy_(buf)
    path.unlink()


def too_big(where: str, run: str, size: int, bound: str) -> Exception:
    from hybrid_engine.pool.cluster import PoolError

    return PoolError(
        f"{where}: run {run}'s state ({size / 1024**3:.3f} GB) alone passes {bound}: it could "
        "not be resident at its turn"
    )


@dataclass
class Slot:
    """A parked run: what `Worker` holds for it while another run's stage runs."""

    roles: dict[str, Any]
    cfg: Any
    driver: dict[str, Any] | None
    rng: dict[str, Any] = field(default_factory=capture_rng)
    nbytes: int = 0
    offloaded: list[tuple[torch.UntypedStorage, int]] | None = None  # freed, on disk


class SlotsMixin:
    """`Worker`'s part for runs sharing the pool: the active run lives in `roles`, `cfg`,
    `driver` (as a single run's would); the others are parked in `slots` by owner, those
    parked longest first."""

    slots: dict[str, Slot]
    roles: dict[str, Any]
    driver: dict[str, Any] | None
    nbytes: int

    @property
    def active_owner(self) -> str | None:
        return (self.driver or {}).get("owner")

    def offload_dir(self) -> Path:
        from hybrid_engine.pool.cluster import state_dir

        return state_dir() / "offload" / self.cfg.ray.pool_name / f"{self.group}-{self.rank}"

    def _offload_path(self, owner: str) -> Path:
        return self.offload_dir() / f"{hashlib.sha256(owner.encode()).hexdigest()[:16]}.bin"

    def _park(self) -> None:
        if self.active_owner is not None and self.roles:
            self.slots[self.active_owner] = Slot(
                self.roles, self.cfg, self.driver, nbytes=self.nbytes
            )
        self.roles, self.driver, self.nbytes = {}, None, 0

    def _fit(self, incoming: int) -> None:
        """Offload parked slots, those parked longest first, until the resident ones and
        `incoming` more bytes fit `ray.max_resident_gb`."""
        bound = self.cfg.ray.max_resident_gb * 1024**3
        for owner, slot in self.slots.items():
            resident = self.nbytes + sum(s.nbytes for s in self.slots.values() if not s.offloaded)
            if resident + incoming <= bound:
                return
            if slot.offloaded is None:
                slot.offloaded = offload(slot.roles, self._offload_path(owner))

    def drop(self, owner: str) -> None:
        """Forget a parked run's slot (its file too, where it was offloaded)."""
        slot = self.slots.pop(owner, None)
        if slot is not None and slot.offloaded is not None:
            self._offload_path(owner).unlink(missing_ok=True)

    def activate(self, owner: str, live: list[str] | None = None) -> float:
        """Swap run `owner`'s slot in (the active one parked, parked ones offloaded as the
        bound needs, its own read back if it was); slots of runs not in `live` (detached:
        their drivers are gone) are dropped. The seconds it took."""
        import time

        from hybrid_engine.pool.cluster import PoolError

        start = time.perf_counter()
        if live is not None:
            for o in [o for o in self.slots if o not in live]:
                self.drop(o)
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
        try:
            self._fit(slot.nbytes)
            if slot.offloaded is not None:
                restore(slot.offloaded, self._offload_path(owner))
                slot.offloaded = None
        except OSError as e:
            self.slots[owner] = slot  # parked as it was: nothing of it lost
            raise PoolError(
                f"pool {self.cfg.ray.pool_name!r}: worker {self.group}-{self.rank} could not "
                f"make room past ray.max_resident_gb={self.cfg.ray.max_resident_gb:g}: {e}"
            ) from None
        self.roles, self.cfg, self.driver, self.nbytes = (
            slot.roles,
            slot.cfg,
            slot.driver,
            slot.nbytes,
        )
        restore_rng(slot.rng)
        return time.perf_counter() - start

    def join(self, cfg: Any, driver: dict[str, Any]) -> int:
        """Attach a run sharing the pool: build its roles in a slot of their own (its own
        seed, optimizer, LoRA, ...) or, when it has one, swap it in and take its settings.
        Refused (PoolError, one line) when its state alone passes `ray.max_resident_gb`, or
        the slots past it would not fit the offload disk; its bytes."""
        from hybrid_engine.config import import_plugins
        from hybrid_engine.pool.cluster import PoolError

        owner = driver["owner"]
        self.sharing = True  # emptied by a run that leaves, it is still healthy
        bound = cfg.ray.max_resident_gb * 1024**3
        line = f"ray.max_resident_gb={cfg.ray.max_resident_gb:g}"
        where = f"pool {cfg.ray.pool_name!r}: worker {self.group}-{self.rank}"
        if self.active_owner == owner or owner in self.slots:  # the pool's first run, built
            self.activate(owner)
            import_plugins(cfg.algorithm.plugins)
            self.cfg, self.driver = cfg, driver
            for role in self.roles.values():
                role.configure(cfg)
            if self.nbytes > bound:
                raise too_big(where, driver["run"], self.nbytes, line)
            return self.nbytes
        have = [s.nbytes for s in self.slots.values()] + ([self.nbytes] if self.roles else [])
        total = sum(have) + max(have, default=0)  # one more run about the size of the others
        if have and total > bound:  # slots past the bound go to disk: it must hold them
            self.offload_dir().mkdir(parents=True, exist_ok=True)
            if total > (free := shutil.disk_usage(self.offload_dir()).free):
                raise PoolError(
                    f"{where} holds {sum(have) / 1024**3:.3f} GB for {len(have)} run(s): one "
                    f"more passes {line} and the offload disk ({self.offload_dir()}) has "
                    f"{free / 1024**3:.3f} GB free of the {total / 1024**3:.3f} GB needed"
                )
        self._park()
        self.cfg = cfg
        try:
            self._fit(max(have, default=0))
        except OSError as e:
            raise PoolError(f"{where}: offloading past {line}: {e}") from None
        import_plugins(cfg.algorithm.plugins)
        self.build(driver)
        if self.nbytes > bound:
            size = self.nbytes
            self.roles, self.driver, self.nbytes = {}, None, 0
            raise too_big(where, driver["run"], size, line)
        self._fit(0)
        return self.nbytes

    def leave(self, owner: str) -> None:
        """A run detached: free its slot."""
        self.drop(owner)
        if self.active_owner == owner:
            self.roles, self.driver, self.nbytes = {}, None, 0

    def runs_info(self) -> list[dict[str, Any]]:
        parked = [(s.driver or {}, s.nbytes, False, bool(s.offloaded)) for s in self.slots.values()]
        active = [(self.driver or {}, self.nbytes, True, False)] if self.roles else []
        return [
            {
                "run": d.get("run"),
                "owner": d.get("owner"),
                "state_gb": n / 1024**3,
                "active": a,
                "offloaded": off,
            }
            for d, n, a, off in active + parked
        ]
