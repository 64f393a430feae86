"""The `hf` rollout backend: `generate(batch, sampling) -> Batch` (the contract: `base`).

It samples with `decode`, a transformers model's forward in `generate`'s loop, on the policy
module itself, so on one CPU rank the rollout "layout" shares the training parameters' storage
(no copy, no sync).
"""

from __future__ import annotations

import hashlib
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
    response_mask_from_ids,
    with_responses,
)
from hybrid_engine.rollout.prefix_cache import (
    PrefixCache,
    fill_past,
    gapped_layout,
    prefix_cache_for,
)
from hybrid_engine.rollout.slots import Slots


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


# free slots are refilled (rows queued) or dropped (none queued) once they are 1/REFILL of the
# batch: one prefill or relayout per quarter of the batch, not one per ended row
REFILL = 4


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of a batch's row `row` (its global index) under the call's `seed`: a
    hash of both, 32 bits (a CPU torch.Generator keeps only a seed's low 32 bits)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{row}".encode(), digest_size=4).digest())


@torch.no_grad()
def decode(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling: SamplingParams,
    eos_token_id: int,
    pad_token_id: int,
    slots: int | None = None,
    join: bool = True,
    on_step: Callable[[int], None] | None = None,
    log_probs: bool = False,
    row_seeds: list[int] | None = None,
    prefixes: PrefixCache | None = None,
    keep: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows, steps) response tokens for left-padded prompts, pad after each row's EOS, and
    with `log_probs` the (rows, steps) log-probs of the sampled tokens under
    softmax(logits / temperature) (temperature 1 when greedy), before top-k/top-p: the
    distribution the training side computes its log-probs from.

    The loop `generate` runs, with four differences that matter on a CPU (bench/rollout.py):
    - continuous batching (`slots`): at most `slots` rows decode at once; a row that ends
      leaves and a queued row joins (without `join`, queued rows wait for the batch to empty:
      batches of `slots` rows, as a split would make them), and when nothing is queued the
      batch shrinks to the rows still open (`Slots`), so few steps are spent on ended rows;
    - a StaticCache, written in place (a DynamicCache concatenates every layer's keys and
      values at every step);
    - GRPO's n samples of a prompt sit in consecutive rows: the rows joining together prefill
      each distinct prompt once and copy its keys and values to its samples;
    - `sample_tokens` draws with one uniform number per row, from the row's own generator
      (`row_seeds`, else seeds drawn from torch's global generator), so a row's tokens do not
      depend on the rows it shares the batch with.
    Positions skip left padding, as in `generate`; greedy gives `generate`'s tokens. `on_step(k)`:
    k rows were open and sampled a token. `prefixes`: a row starting with a stored sequence
    prefills only the rest (`prefix_cache`); with `keep` each row's context and response are
    stored there when it ends."""
    rows, steps = len(prompt_ids), sampling.max_new_tokens
    device = prompt_ids.device
    out = torch.full((rows, steps), pad_token_id, dtype=prompt_ids.dtype, device=device)
    lps = torch.zeros(rows, steps, device=device) if log_probs else None
    emitted = torch.zeros(rows, dtype=torch.long, device=device)
    gens: list[torch.Generator] = []
    if not sampling.greedy:
        if row_seeds is None:
            row_seeds = torch.randint(2**62, (rows,)).tolist()
        gens = [torch.Generator().manual_seed(s) for s in row_seeds]
    warpers = logits_warpers(sampling)
    queue = list(range(rows))
    count = min(slots or rows, rows)
    pool: Slots | None = None
    logits = torch.empty(0)
    while True:
        if pool is not None and not pool.active():
            pool = None  # every row ended: the rows queued start a fresh batch
        free = pool.free() if pool is not None else list(range(min(count, len(queue))))
        if queue and (pool is None or join and len(free) >= max(1, count // REFILL)):
            joining, queue = queue[: len(free)], queue[len(free) :]
            new_logits, cache, mask = prefill(
                model,
                prompt_ids[joining],
                prompt_mask[joining],
                prefixes,
                pad_token_id,
                room=steps if pool is None else 0,
            )
            if pool is None:  # decode in the prefill's own cache
                pool, logits = Slots(model.config, steps, cache, mask, joining), new_logits
            else:
                pool.place(free[: len(joining)], joining, cache, mask)
                logits[free[: len(joining)]] = new_logits
        elif not queue and len(free) >= max(1, len(pool.row) // REFILL):
            logits = logits[pool.compact(drop_free=True)]
        active = pool.active()
        index = torch.tensor(active, device=device)
        rows_now = [pool.row[s] for s in active]  # a list: no device sync per row below
        row = torch.tensor(rows_now, device=device)
        z = logits[index].float()
        scores = warpers(out[:0], z)
        token = sample_tokens(
            scores, sampling.greedy, [gens[r] for r in rows_now] if gens else None
        )
        t = emitted[row]
        out[row, t] = token
        if lps is not None:
            z = z / (sampling.temperature or 1.0)
            lps[row, t] = z.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(z, -1)
        emitted[row] += 1
        if on_step is not None:
            on_step(len(active))
        ended = (token == eos_token_id) | (t + 1 == steps)
        for s in index[ended].tolist():
            r = pool.row[s]
            if keep and prefixes is not None:
                context = prompt_ids[r][prompt_mask[r].bool()].cpu()
                tokens = torch.cat([context, out[r, : int(emitted[r]) - 1].cpu()])
                prefixes.put(tokens, pool.kv(s).cpu())
            pool.row[s] = -1
        if not queue and not pool.active():
            length = int(emitted.max())
            return out[:, :length], None if lps is None else lps[:, :length]
        fed = torch.full((len(pool.row),), pad_token_id, dtype=out.dtype, device=device)
        fed[index] = token
        logits = pool.step(model, fed)


def prefill(
    model: PreTrainedModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    prefixes: PrefixCache | None,
    pad_token_id: int,
    room: int = 0,
) -> tuple[torch.Tensor, StaticCache, torch.Tensor]:
    """Each row's next-token logits after its prompt, and the prompts' keys and values in a
    StaticCache (one row per prompt, attention mask `mask`, `room` free columns after them):
    each distinct prompt of consecutive equal rows runs once, and a prompt starting with a
    sequence in `prefixes` runs only its rest."""
    first = ~repeats_previous_row(ids, mask)
    distinct = first.nonzero().squeeze(-1)
    ids, mask = ids[distinct], mask[distinct]
    real, matches = [], []
    if prefixes is not None:
        real = [r[m.bool()] for r, m in zip(ids.cpu(), mask.cpu(), strict=True)]
        matches = [prefixes.match(r) for r in real]
    past = [n for _, n in matches]
    width_past = 0
    if any(past):  # [past | new tokens]: only the new tokens are prefilled
        ids, mask, width_past = gapped_layout(real, past, pad_token_id)
        ids, mask = ids.to(first.device), mask.to(first.device)
    cache = StaticCache(config=model.config, max_cache_len=mask.shape[1] + room)
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
    if len(distinct) < len(first):
        cache.reorder_cache(prompt_of)
        logits, mask = logits[prompt_of], mask[prompt_of]
    return logits, cache, mask


@ROLLOUT_BACKENDS.register("hf", in_place=True, tensor_parallel=False)
class HFRollout:
    """Batched sampling with `decode` on the policy module (transformers, CPU or GPU)."""

    @classmethod
    def build(cls, cfg: HybridConfig, module: PreTrainedModel, tokenizer: Any) -> HFRollout:
        """The backend of `rollout.name: hf`, on the rollout-layout module."""
        r = cfg.rollout
        pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        return cls(module, pad, eos, r.micro_batch_size, r.prefix_cache_mb, r.continuous_batching)

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        eos_token_id: int,
        micro_batch_size: int,
        prefix_cache_mb: int = 0,
        continuous_batching: bool = True,
    ) -> None:
        self.model = model
        self.continuous_batching = continuous_batching
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.micro_batch_size = micro_batch_size
        self.prefixes = prefix_cache_for(model, prefix_cache_mb)
        self.tokens_so_far, self.started = 0, None  # live progress of the current generate

    def configure(self, cfg: HybridConfig) -> None:
        """A run's rollout settings on an existing backend (a reused pool)."""
        self.micro_batch_size = cfg.rollout.micro_batch_size
        self.continuous_batching = cfg.rollout.continuous_batching
        self.prefixes = prefix_cache_for(self.model, cfg.rollout.prefix_cache_mb)

    def end_rollout(self) -> None:
        """Free the prefix cache: the rollout stage is over (the weights are about to be used,
        or changed, by something else)."""
        if self.prefixes is not None:
            self.prefixes.clear()

    def sync(self, version: Any, weights: Callable[[], tuple[list[str], list[Any]]]) -> float:
        """Nothing to push: this backend generates from the module it was built on."""
        return 0.0

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
            device = self.model.device
            # Each row samples from its own generator, seeded by its global index (`row_offset`:
            # this part's first row), so the samples do not depend on how the batch was split
            # across replicas or into slots.
            if "row_seed" in batch:  # the agent endpoint's own seeds
                seeds = batch["row_seed"].tolist()
            else:
                seeds = [row_seed(sampling.seed, offset + i) for i in range(len(batch))]
            response_ids, lps = decode(
                self.model,
                batch["prompt_ids"].to(device),
                batch["prompt_mask"].to(device),
                sampling,
                eos,
                pad,
                slots=self.micro_batch_size,
                join=self.continuous_batching,
                on_step=self._count,
                log_probs=sampling.log_probs,
                row_seeds=seeds,
                prefixes=prefixes,
                keep=sampling.keep_prefixes,
            )
        finally:
            self.started = None
            self.model.train(was_training)
            if prefixes is not None and not sampling.keep_prefixes:
                prefixes.clear()  # no continuation follows: free the memory now
        seconds = time.perf_counter() - start

        response_ids = response_ids.cpu()
        response_mask = response_mask_from_ids(response_ids, eos)
        response_ids = response_ids.masked_fill(response_mask == 0, pad)
        extra = {}
        if lps is not None:
            extra["rollout_log_probs"] = lps.cpu().masked_fill(response_mask == 0, 0.0)
        out = with_responses(batch, response_ids, response_mask, **extra)
        tokens = int(response_mask.sum())
        out.meta.update(gen_tokens=tokens, gen_seconds=seconds, gen_tokens_per_s=tokens / seconds)
        if prefixes is not None:
            out.meta.update(zip(PREFIX_COUNTS, (prefixes.looked_up, prefixes.reused), strict=True))
        return out
