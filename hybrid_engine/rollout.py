"""Rollout backends: `generate(batch, sampling) -> Batch`.

`hf` samples with transformers' `generate` on the policy module itself, so on one CPU rank
the rollout "layout" shares the training parameters' storage (no copy, no sync).

Input batch: `prompt_ids` (left padded) and `prompt_mask`.
Output adds: `response_ids` (right padded), `response_mask` (1 up to and including EOS),
`input_ids` / `attention_mask` (prompt + response), and in meta the token counts and speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, StoppingCriteria, StoppingCriteriaList

from hybrid_engine.batch import Batch
from hybrid_engine.models import position_ids_from_mask, repeats_previous_row


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def shared_prompt_cache(
    model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> DynamicCache | None:
    """The prompts' keys and values, each distinct prompt computed once.

    GRPO-style batches repeat every prompt `rollout.n` times in consecutive rows. The distinct
    prompts run through the model once (all tokens but the last, which `generate` computes as
    its first step) and each row of the cache is then copied to the samples of its prompt:
    1/n of the prefill work. None when no two consecutive rows are the same prompt."""
    first = ~repeats_previous_row(prompt_ids, prompt_mask)  # the row starts a new prompt
    if prompt_ids.shape[1] < 2 or bool(first.all()):
        return None
    rows = first.nonzero().squeeze(-1)
    ids, mask = prompt_ids[rows, :-1], prompt_mask[rows, :-1]
    if not bool(mask.any(-1).all()):  # a one-token prompt: nothing to share
        return None
    cache = DynamicCache()
    model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
          cache=cache, use_cache=True, logits_to_keep=1)  # fmt: skip
    cache.reorder_cache(first.long().cumsum(0) - 1)  # row i <- its prompt's row
    return cache


class _CountTokens(StoppingCriteria):
    """Never stops generation; counts the response tokens sampled so far (a row's tokens up
    to and including its EOS), for live progress (`HFRollout.progress`)."""

    def __init__(self, rollout: HFRollout, prompt_len: int) -> None:
        self.rollout, self.prompt_len = rollout, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_) -> torch.BoolTensor:
        before = input_ids[:, self.prompt_len : -1]  # this row is still open if no EOS here
        self.rollout.tokens_so_far += int((before != self.rollout.eos_token_id).all(1).sum())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class HFRollout:
    """Batched sampling with `model.generate` (left padding, n samples already repeated)."""

    def __init__(
        self, model: PreTrainedModel, pad_token_id: int, eos_token_id: int, micro_batch_size: int
    ) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.micro_batch_size = micro_batch_size
        self.tokens_so_far, self.started = 0, None  # live progress of the current generate

    def progress(self) -> dict[str, float] | None:
        """Response tokens sampled so far in the generate call running now, and its seconds."""
        started, tokens = self.started, self.tokens_so_far  # another thread may be generating
        if started is None:
            return None
        return {"tokens": tokens, "seconds": time.perf_counter() - started}

    @torch.no_grad()
    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        pad, eos = self.pad_token_id, self.eos_token_id
        was_training = self.model.training
        self.model.eval()
        # Each chunk is seeded by its first row's global index, so the samples do not depend
        # on how the batch was split across replicas (`row_offset` = this part's first row).
        offset = int(batch.meta.get("row_offset", 0))
        start = time.perf_counter()
        self.tokens_so_far, self.started = 0, start
        try:
            chunks = []
            device = self.model.device
            for i, part in enumerate(batch.split(self.micro_batch_size)):
                torch.manual_seed(sampling.seed + offset + i * self.micro_batch_size)
                prompt_ids = part["prompt_ids"].to(device)
                prompt_mask = part["prompt_mask"].to(device)
                out = self.model.generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    cache=shared_prompt_cache(self.model, prompt_ids, prompt_mask),
                    max_new_tokens=sampling.max_new_tokens,
                    do_sample=not sampling.greedy,
                    temperature=sampling.temperature if not sampling.greedy else None,
                    top_p=sampling.top_p if not sampling.greedy else None,
                    top_k=sampling.top_k if not sampling.greedy else None,
                    pad_token_id=pad,
                    eos_token_id=eos,
                    use_cache=True,
                    stopping_criteria=StoppingCriteriaList(
                        [_CountTokens(self, len(prompt_ids[0]))]
                    ),
                )
                chunks.append(out[:, prompt_ids.shape[1] :].cpu())
        finally:
            self.started = None
            self.model.train(was_training)
        seconds = time.perf_counter() - start

        length = max(c.shape[1] for c in chunks)
        response_ids = torch.cat([pad_right(c, length, pad) for c in chunks])
        response_mask = response_mask_from_ids(response_ids, eos)
        response_ids = response_ids.masked_fill(response_mask == 0, pad)
        out = with_responses(batch, response_ids, response_mask)
        tokens = int(response_mask.sum())
        out.meta.update(gen_tokens=tokens, gen_seconds=seconds, gen_tokens_per_s=tokens / seconds)
        return out
