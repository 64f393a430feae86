"""What every rollout backend shares: the sampling parameters and the response tensors built
from sampled ids. The contract: `generate(batch, sampling) -> Batch`.

Input batch: `prompt_ids` (left padded) and `prompt_mask`.
Output adds: `response_ids` (right padded), `response_mask` (1 up to and including EOS),
`input_ids` / `attention_mask` (prompt + response), and in meta the token counts and speed.

Every backend has the method set of `RolloutBackend`, so the roles that own one (the actor,
a rollout replica) call it without asking which backend it is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hybrid_engine.batch import Batch


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of step N (validation uses step -1, evaluation -2)."""
    return (seed * 1_000_003 + step) % 2**63


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    log_probs: bool = False  # also return each sampled token's log-prob (rollout correction)
    # `hf` prefix cache (`rollout.prefix_cache_mb`): the caller sends continuations of these
    # sequences next (the next turn), keep their keys and values; this call continues the
    # calls before it, use what they kept (else it is dropped first: a rollout's values
    # never depend on what ran before it in the process)
    keep_prefixes: bool = False
    reuse_prefixes: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RolloutBackend(Protocol):
    """A registered backend (`ROLLOUT_BACKENDS`); `build(cfg, module, tokenizer)` makes one."""

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch: ...

    def configure(self, cfg: Any) -> None:
        """A run's rollout settings on an existing backend (a reused pool)."""

    def end_rollout(self) -> None:
        """The rollout stage is over: free what only generation uses (a prefix cache)."""

    def sync(self, version: Any, weights: Callable[[], tuple[list[str], list[Any]]]) -> float:
        """Make the backend generate from `version` (`weights()` gives its names and arrays);
        returns the seconds a push took, 0 when none was needed."""

    def progress(self) -> dict[str, float] | None:
        """The generate call running now: response tokens so far and seconds; None if none
        runs or the backend cannot tell."""


# what a generate call with the prefix cache reports in its meta: context tokens looked up,
# and those taken from the cache
PREFIX_COUNTS = ("prefix_lookup_tokens", "prefix_hit_tokens")


def pad_right(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    """Pad the last dimension of a 2-D tensor on the right to `length`."""
    return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value)


def response_mask_from_ids(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 on every token up to and including the first EOS, 0 after it."""
    is_eos = (response_ids == eos_token_id).long()
    eos_before = is_eos.cumsum(-1) - is_eos  # EOS tokens strictly before position t
    return (eos_before == 0).long()


def with_responses(
    batch: Batch, response_ids: torch.Tensor, response_mask: torch.Tensor, **extra: torch.Tensor
) -> Batch:
    """The prompt batch plus its responses and the joined prompt+response sequences."""
    fields = {
        "response_ids": response_ids,
        "response_mask": response_mask,
        "input_ids": torch.cat([batch["prompt_ids"], response_ids], dim=1),
        "attention_mask": torch.cat([batch["prompt_mask"], response_mask], dim=1),
        **extra,
    }
    return batch.union(Batch(fields))
