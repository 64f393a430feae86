"""The `hf` rollout backend: `generate(batch, sampling) -> Batch` (the contract: `base`).

It samples with `decode`, a transformers model's forward in `generate`'s loop, on the policy
module itself, so on one CPU rank the rollout "layout" shares the training parameters' storage
(no copy, no sync).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hybrid_engine.batch import Batch
from hybrid_engine.config import HybridConfig
from hybrid_engine.models.logprobs import position_ids_from_mask, repeats_previous_row
from hybrid_engine.registry import ROLLOUT_BACKENDS
from hybrid_engine.rollout.base import (
    PREFIX_COUNTS,
    SamplingParams,
    pad_right,
    response_mask_from_ids,
    with_responses,
)
from hybrid_engine.rollout.prefix_cache import (
    PrefixCache,
    fill_past,
    gapped_layout,
    prefix_cache_for,
    row_kv,
)


def logits_warpers(sampling: SamplingParams) -> LogitsProcessorList:
    """transformers' temperature, top-k and top-p warpers that `sampling` asks for."""
    warpers = LogitsProcessorList()
    if not sampling.greedy and sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers


_BLOCK = 256  # vocabulary entries per CDF block (SmolLM2: 49152 = 192 blocks)


def sample_tokens(
    logits: torch.Tensor, greedy: bool, generators: list[torch.Generator] | None = None
) -> torch.Tensor:
    """One token per row from (rows, vocab) logits: argmax, or a draw from softmax(logits).
    With `generators` (one per row), row i's uniform number comes from its own generator, so
    its draw does not depend on the other rows of the batch.

    The draw inverts the CDF with one uniform number per row, in two levels: the float64 CDF
    over blocks of 256 entries picks a block, then the float64 CDF inside that block picks the
    token.
    Only the unnormalised probabilities exp(z - max z) span the vocabulary (float32, one pass),
    where a float64 softmax and cumsum over all of it took 11 ms a step at 32 x 49k, and
    `torch.multinomial` (one exponential number per vocabulary entry) about 40 ms: a fifth of
    a decode step of SmolLM2-135M on two CPU cores. Tokens of probability 0 (cut by top-k or
    top-p) are never drawn: their CDF interval is empty, and a draw that rounding carries past
    the last interval takes the last token of nonzero probability."""
    if greedy:
        return logits.argmax(-1)
    rows, vocab = logits.shape
    weights = (logits - logits.amax(-1, keepdim=True)).exp_()
    if vocab % _BLOCK:
        weights = torch.nn.functional.pad(weights, (0, _BLOCK - vocab % _BLOCK))
    blocks = weights.view(rows, -1, _BLOCK)
    mass = blocks.sum(-1).double()  # (rows, blocks): float32 sums of 256, exact to ~1e-7
    cdf = mass.cumsum(-1)
    if generators is None:
        u = torch.rand(rows, 1, dtype=torch.float64, device=logits.device)
    else:
        u = torch.cat([torch.rand(1, 1, dtype=torch.float64, generator=g) for g in generators])
        u = u.to(logits.device)
    u = u * cdf[:, -1:]
    block = _invert(cdf, u)
    inner = blocks[torch.arange(rows, device=logits.device), block].double().cumsum(-1)
    below = cdf.gather(1, block[:, None]) - mass.gather(1, block[:, None])  # mass before it
    token = _invert(inner, (u - below).clamp_(min=0))
    return block * _BLOCK + token


def _invert(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose CDF value exceeds u, at most the last index that adds
    probability (the CDF's first index equal to its total)."""
    index = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    last = (cdf < cdf[:, -1:]).sum(-1)
    return torch.minimum(index, last)


@torch.no_grad()
def decode(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling: SamplingParams,
    eos_token_id: int,
    pad_token_id: int,
    on_step: Callable[[int], None] | None = None,
    log_probs_out: list[torch.Tensor] | None = None,
    row_seeds: list[int] | None = None,
    prefixes: PrefixCache | None = None,
    keep: bool = False,
) -> torch.Tensor:
    """(rows, steps) response tokens for left-padded prompts, pad after each row's EOS.

    The loop `generate` runs, with three differences that matter on a CPU (bench/rollout.py):
    - a StaticCache of prompt width + max_new_tokens, written in place (a DynamicCache
      concatenates every layer's keys and values at every step);
    - GRPO's n samples of a prompt sit in consecutive rows: each distinct prompt is prefilled
      once and its cache rows and first logits are copied to its samples (1/n of the prefill);
    - `sample_tokens` draws with one uniform number per row.
    Positions skip left padding, as in `generate`; greedy gives `generate`'s tokens. Stops when
    every row has emitted EOS. `on_step(k)`: k rows were still open and sampled a token.
    `log_probs_out`, if given, receives per step the (rows,) log-probs of the sampled tokens
    under softmax(logits / temperature) (temperature 1 when greedy), before top-k/top-p: the
    distribution the training side computes its log-probs from. `row_seeds`: each row samples
    from its own generator (the agent endpoint's calls, batched as they come). `prefixes`: a
    row starting with a stored sequence prefills only the rest (`prefix_cache`); with `keep`
    each row's context and response are stored there after the decode."""
    rows = len(prompt_ids)
    steps = sampling.max_new_tokens
    first = ~repeats_previous_row(prompt_ids, prompt_mask)  # the row starts a new prompt
    distinct = first.nonzero().squeeze(-1)
    ids, mask = prompt_ids[distinct], prompt_mask[distinct]
    real, matches = [], []
    if prefixes is not None:
        real = [r[m.bool()] for r, m in zip(ids.cpu(), mask.cpu(), strict=True)]
        matches = [prefixes.match(r) for r in real]
    past = [n for _, n in matches]
    width_past = 0
    if any(past):  # [past | new tokens | decode]: only the new tokens are prefilled
        ids, mask, width_past = gapped_layout(real, past, pad_token_id)
        ids, mask = ids.to(prompt_ids.device), mask.to(prompt_ids.device)
    width = mask.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=width + steps)
    if width_past:
        fill_past(cache, [e for e, _ in matches], past, width_past, ids.device)
    logits = model(
        input_ids=ids,
        attention_mask=mask,
        cache=cache,
        position_ids=position_ids_from_mask(mask)[:, width_past:],
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    prompt_of = first.long().cumsum(0) - 1  # row i <- its prompt's row
    if len(distinct) < rows:
        cache.reorder_cache(prompt_of)
        logits = logits[prompt_of]
    warpers = logits_warpers(sampling)
    mask = torch.cat([mask[prompt_of], mask.new_ones(rows, steps)], 1)
    position = prompt_mask.sum(-1, keepdim=True)  # of the first response token
    out = torch.full((rows, steps), pad_token_id, dtype=prompt_ids.dtype, device=prompt_ids.device)
    done = torch.zeros(rows, dtype=torch.bool, device=prompt_ids.device)
    gens = None if row_seeds is None else [torch.Generator().manual_seed(s) for s in row_seeds]
    for t in range(steps):
        scores = warpers(out[:, :t], logits.float())
        token = sample_tokens(scores, sampling.greedy, gens).masked_fill_(done, pad_token_id)
        out[:, t] = token
        if log_probs_out is not None:
            z = logits.float() / (sampling.temperature or 1.0)
            lp = z.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(z, -1)
            log_probs_out.append(lp.masked_fill_(done, 0.0))
        if on_step is not None:
            on_step(int((~done).sum()))
        done |= token == eos_token_id
        if t == steps - 1 or bool(done.all()):
            if keep and prefixes is not None:
                contexts = [real[j] for j in prompt_of.tolist()]
                store(prefixes, cache, contexts, out[:, :t], mask, eos_token_id)
            return out[:, : t + 1]
        logits = model(
            input_ids=token[:, None],
            attention_mask=mask[:, : width + t + 1],
            position_ids=position + t,
            cache=cache,
            use_cache=True,
            cache_position=torch.tensor([width + t], device=mask.device),
        ).logits[:, -1]
    return out


def store(
    prefixes: PrefixCache,
    cache: StaticCache,
    contexts: list[torch.Tensor],
    fed: torch.Tensor,
    mask: torch.Tensor,
    eos_token_id: int,
) -> None:
    """Each row's context and the response tokens fed back so far (`fed`, up to its EOS)
    into `prefixes`, with their keys and values from the decode's cache."""
    lengths = response_mask_from_ids(fed, eos_token_id).sum(-1).tolist()
    for i, (context, n) in enumerate(zip(contexts, lengths, strict=True)):
        tokens = torch.cat([context, fed[i, :n].cpu()])
        slots = mask[i].nonzero().squeeze(-1)[: len(tokens)]
        prefixes.put(tokens, row_kv(cache, i, slots).cpu())


@ROLLOUT_BACKENDS.register("hf", in_place=True, tensor_parallel=False, separate_group=True)
class HFRollout:
    """Batched sampling with `decode` on the policy module (transformers, CPU or GPU)."""

    @classmethod
    def build(cls, cfg: HybridConfig, module: PreTrainedModel, tokenizer: Any) -> HFRollout:
        """The backend of `rollout.name: hf`, on the rollout-layout module."""
        r = cfg.rollout
        pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        return cls(module, pad, eos, r.micro_batch_size, r.prefix_cache_mb)

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        eos_token_id: int,
        micro_batch_size: int,
        prefix_cache_mb: int = 0,
    ) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.micro_batch_size = micro_batch_size
        self.prefixes = prefix_cache_for(model, prefix_cache_mb)
        self.tokens_so_far, self.started = 0, None  # live progress of the current generate

    def configure(self, cfg: HybridConfig) -> None:
        """A run's rollout settings on an existing backend (a reused pool)."""
        self.micro_batch_size = cfg.rollout.micro_batch_size
        self.prefixes = prefix_cache_for(self.model, cfg.rollout.prefix_cache_mb)

    def drop_prefixes(self) -> None:
        """Free the prefix cache: the rollout stage is over (the weights are about to be used,
        or changed, by something else)."""
        if self.prefixes is not None:
            self.prefixes.clear()

    def _count(self, tokens: int) -> None:
        self.tokens_so_far += tokens

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
        prefixes = self.prefixes
        if prefixes is not None:
            prefixes.check_weights(self.model)
            if not sampling.reuse_prefixes:
                prefixes.clear()
            if not sampling.keep_prefixes and not len(prefixes):
                prefixes = None
            else:
                prefixes.looked_up = prefixes.reused = 0  # this call's counts
        start = time.perf_counter()
        self.tokens_so_far, self.started = 0, start
        try:
            chunks, lp_chunks = [], []
            device = self.model.device
            for i, part in enumerate(batch.split(self.micro_batch_size)):
                torch.manual_seed(sampling.seed + offset + i * self.micro_batch_size)
                prompt_ids = part["prompt_ids"].to(device)
                prompt_mask = part["prompt_mask"].to(device)
                steps: list[torch.Tensor] | None = [] if sampling.log_probs else None
                seeds = part["row_seed"].tolist() if "row_seed" in part else None
                out = decode(
                    self.model,
                    prompt_ids,
                    prompt_mask,
                    sampling,
                    eos,
                    pad,
                    on_step=self._count,
                    log_probs_out=steps,
                    row_seeds=seeds,
                    prefixes=prefixes,
                    keep=sampling.keep_prefixes,
                )
                chunks.append(out.cpu())
                if steps is not None:
                    lp_chunks.append(torch.stack(steps, 1).cpu())
        finally:
            self.started = None
            self.model.train(was_training)
            if prefixes is not None and not sampling.keep_prefixes:
                prefixes.clear()  # no continuation follows: free the memory now
        seconds = time.perf_counter() - start

        length = max(c.shape[1] for c in chunks)
        response_ids = torch.cat([pad_right(c, length, pad) for c in chunks])
        response_mask = response_mask_from_ids(response_ids, eos)
        response_ids = response_ids.masked_fill(response_mask == 0, pad)
        extra = {}
        if lp_chunks:
            lps = torch.cat([pad_right(c, length, 0) for c in lp_chunks])
            extra["rollout_log_probs"] = lps.masked_fill(response_mask == 0, 0.0)
        out = with_responses(batch, response_ids, response_mask, **extra)
        tokens = int(response_mask.sum())
        out.meta.update(gen_tokens=tokens, gen_seconds=seconds, gen_tokens_per_s=tokens / seconds)
        if prefixes is not None:
            out.meta.update(zip(PREFIX_COUNTS, (prefixes.looked_up, prefixes.reused), strict=True))
        return out
