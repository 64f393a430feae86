"""Continuous batching for the `hf` rollout: a StaticCache whose batch rows are *slots*.

A sequence joins a free slot with its prompt's keys and values written right-aligned, so they
end at the cache's write column; it then decodes one token per step with the others and frees
the slot when it ends, and a queued sequence takes the slot. Every slot writes at the same
column each step (a StaticCache has one write position); a slot's attention mask covers only
its own columns and its positions count only its own tokens, so each sequence sees what it
would see decoded alone. The values agree to float rounding, not bit for bit (the matmuls run
at other shapes).

The first sequences decode in the cache their prompts were prefilled into. Besides writing a
newcomer's prompt in, `relayout` is the one copy, a layer at a time: when the write column
reaches the end it drops the columns no sequence still uses (and makes room on the left for a
newcomer's longer prompt), and when nothing is queued it drops the free slots, so the rows
left decode in a smaller batch.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, StaticCache


class Slots:
    """The slots of one StaticCache, with room for `steps` more tokens after each relayout."""

    def __init__(
        self,
        config: PretrainedConfig,
        steps: int,
        cache: StaticCache,
        mask: torch.Tensor,
        rows: list[int],
    ) -> None:
        """Slots for `rows`, whose prompts `cache` holds prefilled (attention mask `mask`),
        with room for `steps` more columns after them."""
        keys = cache.layers[0].keys
        self.config, self.steps = config, steps
        _, self.heads, _, self.dim = keys.shape
        self.dtype, self.device = keys.dtype, keys.device
        self.row = list(rows)  # the sequence in each slot; -1: free
        self.mask = torch.cat([mask, mask.new_zeros(len(rows), steps)], 1)
        self.position = mask.sum(-1)
        self.col = mask.shape[1]  # the write column
        self.cache = cache

    def free(self) -> list[int]:
        return [s for s, r in enumerate(self.row) if r < 0]

    def active(self) -> list[int]:
        return [s for s, r in enumerate(self.row) if r >= 0]

    def relayout(self, keep: list[int], col: int) -> None:
        """Keep the slots `keep`, in that order, with the write column moved to `col`: the last
        min(col, old col) columns are copied to end there, and `steps` columns follow."""
        span = min(col, self.col)
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self.mask.new_zeros(len(keep), col + self.steps)
        mask[:, col - span : col] = self.mask[index, self.col - span : self.col]
        if col:
            empty = mask[:, :col].sum(-1) == 0  # a free slot whose columns were dropped
            mask[empty, col - 1] = 1  # attends one stale column: finite, and never read
        cache = StaticCache(config=self.config, max_cache_len=col + self.steps)
        shape = (len(keep), self.heads, 1, self.dim)
        stub = torch.empty(shape, dtype=self.dtype, device=self.device)
        for new, old in zip(cache.layers, self.cache.layers, strict=True):
            new.lazy_initialization(stub, stub)  # one layer at a time: the copy costs one
            if span:  # layer's memory, not the whole cache's
                new.keys[:, :, col - span : col] = old.keys[index, :, self.col - span : self.col]
                new.values[:, :, col - span : col] = old.values[
                    index, :, self.col - span : self.col
                ]
            old.keys = old.values = None
        for layer in cache.layers:
            layer.cumulative_length.fill_(col)
        self.cache, self.mask, self.col = cache, mask, col
        self.position = self.position[index]
        self.row = [self.row[s] for s in keep]

    def compact(self, drop_free: bool) -> list[int]:
        """Relayout to the columns the active slots use (and without the free slots when
        `drop_free`); returns the slots kept, by their old index."""
        keep = self.active() if drop_free else list(range(len(self.row)))
        active = torch.tensor([self.row[s] >= 0 for s in keep], device=self.device)
        first = self.mask[keep].argmax(-1)  # each slot's first column in use
        start = int(first[active].min()) if bool(active.any()) else self.col
        self.relayout(keep, self.col - start)
        return keep

    def place(
        self, slots: list[int], rows: list[int], cache: StaticCache, mask: torch.Tensor
    ) -> None:
        """Sequences `rows` into free `slots`: their prefilled keys and values (`cache`, mask
        `mask`, one row per sequence) end at the write column."""
        width = mask.shape[1]
        if width > self.col:  # room on the left for the newcomers' prompts
            self.relayout(list(range(len(self.row))), width)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        start = self.col - width
        self.mask[index] = 0
        self.mask[index, start : self.col] = mask
        for layer, new in zip(self.cache.layers, cache.layers, strict=True):
            layer.keys[index, :, start : self.col] = new.keys[:, :, :width]
            layer.values[index, :, start : self.col] = new.values[:, :, :width]
        self.position[index] = mask.sum(-1)
        for s, r in zip(slots, rows, strict=True):
            self.row[s] = r

    def step(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per slot (free slots: anything, masked out) and return the next
        logits, (slots, vocab)."""
        if self.col == self.mask.shape[1]:
            self.compact(drop_free=False)
        active = torch.tensor([r >= 0 for r in self.row], device=self.device)
        self.mask[active, self.col] = 1
        logits = model(
            input_ids=tokens[:, None],
            attention_mask=self.mask[:, : self.col + 1],
            position_ids=self.position[:, None],
            cache=self.cache,
            use_cache=True,
            cache_position=torch.tensor([self.col], device=self.device),
        ).logits[:, -1]
        self.position += active.long()
        self.col += 1
        return logits

    def kv(self, slot: int) -> torch.Tensor:
        """(layers, 2, kv_heads, tokens, head_dim): the keys and values of the slot's
        sequence, in order."""
        columns = self.mask[slot].nonzero().squeeze(-1)
        return torch.stack(
            [
                torch.stack([layer.keys[slot][:, columns], layer.values[slot][:, columns]])
                for layer in self.cache.layers
            ]
        )
