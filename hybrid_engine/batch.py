"""The one container every stage passes around: named tensors + per-sample values + meta.

A `Batch` holds
- `tensors`: torch tensors that all share the first dimension (the samples),
- `non_tensors`: per-sample Python values (str, int, float, bool, None, lists/dicts of those)
  kept as lists of the same length,
- `meta`: batch-level JSON values (step, timings, sampling settings, ...).

It serialises to safetensors (tensors) + JSON (the rest). There is no pickle anywhere, so
bytes read back from a bucket can never run code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

TENSORS_FILE = "batch.safetensors"
JSON_FILE = "batch.json"


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, list[Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensors = {k: list(v) for k, v in self.non_tensors.items()}
        self._check()

    # ------------------------------------------------------------------ basics
    def _check(self) -> None:
        sizes = {k: t.shape[0] for k, t in self.tensors.items()}
        sizes |= {k: len(v) for k, v in self.non_tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the number of samples: {sizes}")
        both = self.tensors.keys() & self.non_tensors.keys()
        if both:
            raise ValueError(f"Batch keys are both tensor and non-tensor: {sorted(both)}")

    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str) -> torch.Tensor | list[Any]:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"Batch has no field {key!r}; it has {sorted(self.keys())}")

    def __setitem__(self, key: str, value: torch.Tensor | Sequence[Any]) -> None:
        if isinstance(value, torch.Tensor):
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
        else:
            self.tensors.pop(key, None)
            self.non_tensors[key] = list(value)
        self._check()

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    # ------------------------------------------------------------- reshaping
    def select(self, keys: Iterable[str], meta: bool = True) -> Batch:
        """A batch with only the named fields (sharing tensor storage)."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no field(s) {missing}; it has {sorted(self.keys())}")
        return Batch(
            {k: self.tensors[k] for k in keys if k in self.tensors},
            {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
            dict(self.meta) if meta else {},
        )

    def take(self, idx: Sequence[int] | torch.Tensor | slice) -> Batch:
        """The samples at `idx` (a slice, a list of ints or an index tensor)."""
        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
            tensors = {k: t[idx] for k, t in self.tensors.items()}
        else:
            rows = [int(i) for i in idx]
            index = torch.as_tensor(rows, dtype=torch.long)
            tensors = {k: t.index_select(0, index) for k, t in self.tensors.items()}
        non = {k: [v[i] for i in rows] for k, v in self.non_tensors.items()}
        return Batch(tensors, non, dict(self.meta))

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of `size` samples (the last may be smaller)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.take(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list[Batch]:
        """`n` consecutive chunks of equal size; the batch length must divide by `n`."""
        if n <= 0 or len(self) % n:
            raise ValueError(f"cannot chunk a batch of {len(self)} samples into {n} equal parts")
        return self.split(len(self) // n)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Samples of all batches, in order. Meta is taken from the first batch."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for b in batches[1:]:
            if set(b.tensors) != set(first.tensors) or set(b.non_tensors) != set(first.non_tensors):
                raise ValueError(
                    f"concat: fields differ: {sorted(first.keys())} vs {sorted(b.keys())}"
                )
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        non = {k: [x for b in batches for x in b.non_tensors[k]] for k in first.non_tensors}
        return Batch(tensors, non, dict(first.meta))

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with its tensors on `device` (no copy when already there)."""
        return Batch(
            {k: t.to(device) for k, t in self.tensors.items()}, self.non_tensors, self.meta
        )

    def repeat_interleave(self, n: int) -> Batch:
        """Each sample repeated `n` times in place: [a, b] -> [a, a, b, b] for n=2."""
        tensors = {k: t.repeat_interleave(n, dim=0) for k, t in self.tensors.items()}
        non = {k: [x for x in v for _ in range(n)] for k, v in self.non_tensors.items()}
        return Batch(tensors, non, dict(self.meta))

    def union(self, other: Batch) -> Batch:
        """Fields of both batches. A field in both must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"union: {len(self)} samples vs {len(other)}")
        tensors = dict(self.tensors)
        for k, t in other.tensors.items():
            if k in tensors and not torch.equal(tensors[k], t):
                raise ValueError(f"union: tensor {k!r} differs between the two batches")
            tensors[k] = t
        non = dict(self.non_tensors)
        for k, v in other.non_tensors.items():
            if k in non and non[k] != v:
                raise ValueError(f"union: field {k!r} differs between the two batches")
            non[k] = v
        return Batch(tensors, non, {**self.meta, **other.meta})

    # ------------------------------------------------------------ persistence
    def to_bytes(self) -> tuple[bytes, bytes]:
        """(safetensors bytes, JSON bytes) for the tensors and for everything else."""
        # clones: safetensors refuses fields that share memory (returns = advantages in GRPO)
        tensors = {k: t.detach().cpu().clone() for k, t in self.tensors.items()}
        doc = {"non_tensors": self.non_tensors, "meta": self.meta, "len": len(self)}
        return st_save(tensors), json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, tensor_bytes: bytes, json_bytes: bytes) -> Batch:
        doc = json.loads(json_bytes)
        return cls(st_load(tensor_bytes), doc["non_tensors"], doc["meta"])

    def save(self, directory: str | Path) -> None:
        """Write `batch.safetensors` and `batch.json` into `directory`."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tb, jb = self.to_bytes()
        (d / TENSORS_FILE).write_bytes(tb)
        (d / JSON_FILE).write_bytes(jb)

    @classmethod
    def load(cls, directory: str | Path) -> Batch:
        d = Path(directory)
        return cls.from_bytes((d / TENSORS_FILE).read_bytes(), (d / JSON_FILE).read_bytes())
