"""Training layout (FSDP2), rollout layout (full weights) and the resharding between them.

- `init_group` joins the worker group's torch.distributed world (gloo on CPU, NCCL on GPU).
- `shard_model` applies FSDP2: `fully_shard` on every decoder layer, then on the root. With
  one rank the model stays a plain module.
- `RolloutWeights` gives the rollout engine full weights. One rank: the rollout module *is* the
  training module (same storage, no copy). FSDP: before generation every parameter is gathered,
  one at a time, from its shards into a full-weight rollout module; after generation the full
  tensors are dropped again (`separate_copy` keeps them, the baseline that bench/memory.py
  compares against).
- `engine_weights` gives an engine in another process (vLLM) full weights as numpy arrays.
- `save_state` / `load_state` lay out a role's weights (full, safetensors), optimizer and
  scheduler state, and RNG state, written and read at an fsspec URL through
  `hybrid_engine.files`. The files do not depend on the number of ranks: a state saved with
  2 ranks loads into 1.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from peft import LoraConfig
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor, init_device_mesh

from hybrid_engine.files import read_object, write_object
from hybrid_engine.models.lora import merged_state_dict

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL_TRAINABLE = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


# ------------------------------------------------------------------ process group
def init_group(
    rank: int, world_size: int, init_method: str, timeout_s: float, backend: str = "gloo"
) -> None:
    """Join the group's world; a collective waits at most `timeout_s` for a peer.
    gloo for CPU tensors (the training layout here); nccl once training runs on GPUs."""
    if world_size == 1 or dist.is_initialized():
        return
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_sum(value: float) -> float:
    """Sum of `value` over the group's ranks (itself with one rank)."""
    if world_size() == 1:
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t)


# ------------------------------------------------------------------ training layout
def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP shards one by one (HF's `_no_split_modules` classes)."""
    names = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: nn.Module) -> nn.Module:
    """FSDP2 over the current world: each decoder layer is one unit, the rest the root."""
    if world_size() == 1:
        return model
    mesh = init_device_mesh(next(model.parameters()).device.type, (world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def local_numel(model: nn.Module) -> int:
    """Parameters this rank holds (its shards)."""
    return sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()
    )


def to_float(x: torch.Tensor | float) -> float:
    """A scalar that may be a DTensor (e.g. FSDP's grad norm)."""
    if isinstance(x, DTensor):
        x = x.full_tensor()
    return float(x)


# ------------------------------------------------------------------- rollout layout
class RolloutWeights:
    """Full weights for generation, taken from the training layout in memory."""

    def __init__(self, train_model: nn.Module, separate_copy: bool) -> None:
        """Call before `shard_model(train_model)`: the rollout module is cloned full-size."""
        self.train_model = train_model
        self.shares_storage = world_size() == 1 and not separate_copy
        self.keep = separate_copy
        self.synced_version = -1
        self.gather_seconds = 0.0
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        if self.shares_storage:
            self.module = train_model
            return
        self.module = copy.deepcopy(train_model).requires_grad_(False)

    def bind(self) -> None:
        """Pair rollout and training parameters by name (after sharding) and drop the copy's
        tensors until the first gather."""
        if self.shares_storage:
            return
        train = dict(self.train_model.named_parameters())
        roll = dict(self.module.named_parameters())
        if train.keys() != roll.keys():
            raise RuntimeError("rollout and training modules have different parameters")
        self._pairs = [(train[k], roll[k]) for k in train]
        if not self.keep:
            self.release()

    def gather(self, version: int) -> float:
        """Make the rollout module hold weights `version`; returns the seconds it took.
        Every rank of the group must call it (each shard is all-gathered in turn)."""
        if self.shares_storage or self.synced_version == version:
            return 0.0
        start = time.perf_counter()
        with torch.no_grad():
            for train_p, roll_p in self._pairs:
                if isinstance(train_p, DTensor):
                    roll_p.data = train_p.full_tensor()  # one all-gather per parameter
                else:
                    roll_p.data.copy_(train_p.detach())  # separate copy at one rank
        self.synced_version = version
        self.gather_seconds = time.perf_counter() - start
        return self.gather_seconds

    def release(self) -> None:
        """Free the full tensors (the training layout keeps its shards)."""
        if self.shares_storage or self.keep:
            return
        for _, roll_p in self._pairs:
            roll_p.data = torch.empty(0, dtype=roll_p.dtype, device=roll_p.device)
        self.synced_version = -1

    def data_ptrs(self) -> list[int]:
        return [p.data_ptr() for p in self.module.parameters()]


# ------------------------------------------------------------------------ state
def full_state_dict(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU weights (only those that train, with `trainable_only`: LoRA's
    adapters); every rank must call it, rank 0 receives them."""
    if not trainable_only:
        return get_model_state_dict(model, options=FULL)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    state = get_model_state_dict(model, options=FULL_TRAINABLE)
    return {k: v for k, v in state.items() if k in names}  # a tied frozen alias slips through


def _dedup(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses shared storage (tied embeddings): keep one, record the aliases."""
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    out, aliases = {}, {}
    for k, t in tensors.items():
        key = (t.data_ptr(), tuple(t.shape))
        if t.numel() and key in seen:
            aliases[k] = seen[key]
        else:
            seen[key] = k
            out[k] = t.contiguous()
    return out, aliases


def save_state(
    url: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    extra: dict,
    storage_options: dict | None = None,
    trainable_only: bool = False,
) -> dict[str, str]:
    """Write `model.safetensors`, `optim.safetensors`, `state.json` (rank 0) and
    `rng_rank<r>.safetensors` (every rank) under `url`. All ranks must call it.
    With `trainable_only` the weights file holds only the parameters that train (LoRA: the
    adapters; the frozen base is rebuilt from the model's source).
    Returns {file name: sha256} of what this rank wrote."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    weights = full_state_dict(model, trainable_only)
    optim = full_optimizer_state(model, optimizer) if optimizer else None

    def write(name: str, data: bytes) -> None:
        written[name] = write_object(f"{url}/{name}", data, storage_options)

    written: dict[str, str] = {}
    write(f"rng_rank{rank}.safetensors", st_save({"torch": torch.get_rng_state()}))
    if rank != 0:
        dist.barrier()  # returns once rank 0 has written everything
        return written
    try:
        tensors, aliases = _dedup(weights)
        write("model.safetensors", st_save(tensors))
        doc = {"aliases": aliases, "extra": extra}
        if optim is not None:
            flat = {
                f"{name}::{k}": torch.as_tensor(v).contiguous()
                for name, st in optim["state"].items()
                for k, v in st.items()
            }
            write("optim.safetensors", st_save(flat))
            doc["param_groups"] = optim["param_groups"]
        if scheduler is not None:
            doc["scheduler"] = {
                k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"
            }
        write("state.json", json.dumps(doc, sort_keys=True, default=list).encode())
    finally:  # a failed write (a full disk) must not leave the other ranks at the barrier
        if dist.is_initialized():
            dist.barrier()
    return written


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`full` in `param`'s layout: this rank's shard (no communication) or the tensor itself."""
    full = full.to(param.device, param.dtype)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


def load_state(
    url: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    storage_options: dict | None = None,
    expected: dict[str, str] | None = None,
    trainable_only: bool = False,
) -> dict:
    """Read what `save_state` wrote into this rank's layout; returns the saved `extra`.
    With `trainable_only` only the parameters that train are read (and required).

    Every rank reads the full files and keeps its own shards, so no collective is needed
    and any rank count can load any save. With `expected` ({file name: sha256}) every file
    is checked before anything is changed: a mismatch raises `CorruptObject`."""
    rank = dist.get_rank() if dist.is_initialized() else 0

    def read(name: str) -> bytes:
        return read_object(f"{url}/{name}", storage_options, expected)

    doc = json.loads(read("state.json"))
    weights = st_load(read("model.safetensors"))
    flat = st_load(read("optim.safetensors")) if optimizer and "param_groups" in doc else None
    rng = None
    with contextlib.suppress(FileNotFoundError):  # saved with fewer ranks: keep this RNG
        rng = st_load(read(f"rng_rank{rank}.safetensors"))["torch"]
    for alias, target in doc["aliases"].items():
        weights[alias] = weights[target]
    params = {n: p for n, p in model.named_parameters() if p.requires_grad or not trainable_only}
    missing = sorted(params.keys() - weights.keys())
    if missing:
        raise ValueError(f"{url}/model.safetensors lacks {missing[:5]} (another model?)")
    with torch.no_grad():
        for name, p in params.items():
            src = _like(weights[name], p)
            if isinstance(p, DTensor):
                p.to_local().copy_(src.to_local())
            else:
                p.copy_(src)
    if optimizer is not None and flat is not None:
        state: dict[int, dict[str, torch.Tensor]] = {}
        # the optimizer was built from model.parameters(): its indices follow that order
        for i, (name, p) in enumerate(params.items()):
            keys = [k for k in flat if k.rsplit("::", 1)[0] == name]
            if keys:
                state[i] = {
                    k.rsplit("::", 1)[1]: flat[k] if flat[k].dim() == 0 else _like(flat[k], p)
                    for k in keys
                }
        groups, start = [], 0
        for g in doc["param_groups"]:
            n = len(g["params"])
            groups.append(
                {**g, "betas": tuple(g["betas"]), "params": list(range(start, start + n))}
            )
            start += n
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    if scheduler is not None and "scheduler" in doc:
        scheduler.load_state_dict({**scheduler.state_dict(), **doc["scheduler"]})
    if rng is not None:
        torch.set_rng_state(rng)
    return doc["extra"]


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"state": {param name: {key: full tensor}}, "param_groups": [{..., "params": [names]}]},
    gathered parameter by parameter (a collective: every rank calls it, same order). Written
    out here rather than with `get_optimizer_state_dict`, which after a load of this state
    gathered some parameters' exp_avg into exp_avg_sq (measured, torch 2.13, FSDP2, gloo)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state: dict[str, dict[str, torch.Tensor]] = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [names[id(p)] for p in group["params"]],
            }
        )
        for p in group["params"]:
            st = optimizer.state.get(p) or {}
            state[names[id(p)]] = {
                k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
                for k, v in sorted(st.items())
            }
    return {"state": {n: st for n, st in state.items() if st}, "param_groups": groups}


def engine_weights(
    model: nn.Module, lora: LoraConfig | None = None
) -> tuple[list[str], list[np.ndarray]]:
    """(HF names, numpy arrays) of every weight a rollout engine in another process loads
    (vLLM), one full copy each: plain data, readable without this environment's torch.

    `named_parameters()` lists a tied `lm_head.weight` under the embedding only; vLLM's CPU
    backend prepacks its LM head separately, so it is pushed under its own name too (else the
    engine keeps the old LM head silently). FSDP shards are gathered (`full_tensor`). With
    LoRA (`lora` given) the adapters are folded into the base weights (`merged_state_dict`):
    the engine serves the plain model the adapters make.
    """
    full = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        full[name] = t.to("cpu", copy=True)
    if lora is not None:
        full = merged_state_dict(full, lora)
    return list(full), [t.contiguous().numpy() for t in full.values()]
