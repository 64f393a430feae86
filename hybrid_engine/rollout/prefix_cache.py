"""The `hf` rollout's KV prefix cache: keys and values of sequences it already ran, reused by
later rows that start with the same tokens (the next turn of a multi-turn trajectory, the next
call of an agent episode), so only the new tokens are prefilled.

A row matches the stored sequence sharing its longest common prefix of token ids; the first
`n` positions of that sequence's keys and values are its past (position j's keys and values
depend on tokens 0..j alone, so any common prefix is exact). Entries are evicted least
recently used first to stay within a byte budget, and the whole cache is dropped when the
weights may have changed: after any optimizer step in the process (a global step hook counts
them) or a write to a parameter (a load bumps its version counter).

In the decode layout a batch with a past is `[past, right-aligned | new tokens, left-padded |
decode steps]`; the gaps are masked out and positions count only real tokens, so attention sees
what a fresh prefill of the whole context sees. The values agree to float rounding (the
matmuls run at other shapes), not bit for bit.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

# Optimizer steps taken in this process. The fused AdamW writes the parameters without bumping
# their version counters, so a step is seen here instead.
_steps = [0]
register_optimizer_step_post_hook(lambda *_: _steps.__setitem__(0, _steps[0] + 1))


@dataclass
class Entry:
    ids: torch.Tensor  # (L,) the tokens
    kv: torch.Tensor  # (layers, 2, kv_heads, L, head_dim): keys and values of every layer

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class PrefixCache:
    """Stored sequences and their keys and values, least recently used first."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.nbytes = 0
        self._next_key = 0
        self._weights: tuple | None = None
        self.looked_up = self.reused = 0  # context tokens matched against the cache, and hits

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def check_weights(self, model: torch.nn.Module) -> None:
        """Drop everything if the parameters may have changed since the entries were made: an
        optimizer step anywhere in the process, a write to a parameter (a load), or another
        parameter storage."""
        weights = (_steps[0], *((p.data_ptr(), p._version) for p in model.parameters()))
        if weights != self._weights:
            self.clear()
            self._weights = weights

    def match(self, ids: torch.Tensor) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `ids` (leaving at least its last token to
        prefill, whose logits start the decode) and that prefix's length."""
        self.looked_up += len(ids)
        best, length = None, 0
        for key, entry in self.entries.items():
            m = min(len(entry.ids), len(ids) - 1)
            if m <= length:
                continue
            differ = (entry.ids[:m] != ids[:m]).nonzero()
            common = int(differ[0]) if len(differ) else m
            if common > length:
                best, length = key, common
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        self.reused += length
        return self.entries[best], length

    def put(self, ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Store a sequence; entries it extends are dropped, then the oldest ones until the
        cache fits its budget. A sequence larger than the budget is not stored."""
        for key, entry in list(self.entries.items()):
            n = len(entry.ids)
            if n <= len(ids) and torch.equal(entry.ids, ids[:n]):
                self.nbytes -= self.entries.pop(key).nbytes
        entry = Entry(ids, kv)
        if entry.nbytes > self.budget:
            return
        self.entries[self._next_key] = entry
        self._next_key += 1
        self.nbytes += entry.nbytes
        while self.nbytes > self.budget:
            self.nbytes -= self.entries.popitem(last=False)[1].nbytes


def prefix_cache_for(model: torch.nn.Module, megabytes: int) -> PrefixCache | None:
    """A cache of `megabytes` for `model`, or None when off or when its StaticCache has layers
    other than full attention (sliding-window or linear-attention layers: not built)."""
    if not megabytes:
        return None
    probe = StaticCache(config=model.config, max_cache_len=1)
    if any(type(layer) is not StaticLayer for layer in probe.layers):
        return None
    return PrefixCache(megabytes * 2**20)


def gapped_layout(
    ids: list[torch.Tensor], past: list[int], pad: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows whose first `past[i]` tokens have keys and values already: the new tokens, left
    padded, (rows, S); the attention mask over `[past | new]`, (rows, P + S), with each row's
    past right-aligned in the first P = max(past) columns; and P."""
    width_past = max(past)
    width_new = max(len(r) - p for r, p in zip(ids, past, strict=True))
    new = torch.full((len(ids), width_new), pad, dtype=ids[0].dtype)
    mask = torch.zeros(len(ids), width_past + width_new, dtype=torch.long)
    for i, (row, p) in enumerate(zip(ids, past, strict=True)):
        n = len(row) - p
        new[i, width_new - n :] = row[p:]
        mask[i, width_past - p : width_past] = 1
        mask[i, width_past + width_new - n :] = 1
    return new, mask, width_past


def fill_past(
    cache: StaticCache,
    entries: list[Entry | None],
    past: list[int],
    width: int,
    device: torch.device,
) -> None:
    """Write each row's past keys and values right-aligned into the first `width` slots of an
    empty StaticCache on `device`, as if they had been prefilled there."""
    sample = next(e for e in entries if e is not None).kv
    _, _, heads, _, dim = sample.shape
    cache.early_initialization(len(entries), heads, dim, sample.dtype, device)
    for i, (entry, n) in enumerate(zip(entries, past, strict=True)):
        if entry is None or n == 0:
            continue
        for layer, kv in zip(cache.layers, entry.kv[:, :, :, :n].to(device), strict=True):
            layer.keys[i, :, width - n : width] = kv[0]
            layer.values[i, :, width - n : width] = kv[1]
    for layer in cache.layers:
        layer.cumulative_length.fill_(width)
