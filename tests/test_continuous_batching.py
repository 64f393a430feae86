"""Continuous batching in the `hf` rollout: rows that end leave, queued rows join, and the
tokens and log-probs are those of decoding every row in one batch (and of a fresh forward)."""

import pytest
import torch

from hybrid_engine.batch import Batch
from hybrid_engine.config import ModelConfig
from hybrid_engine.models.loading import load_policy
from hybrid_engine.models.logprobs import response_log_probs
from hybrid_engine.rollout.base import SamplingParams, response_mask_from_ids
from hybrid_engine.rollout.hf import HFRollout, decode
from hybrid_engine.rollout.multiturn import left_padded

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """The tiny model and five prompts of random tokens (4 to 20), two rows each."""
    model = load_policy(ModelConfig(path="tiny"), tokenizer, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 5000, (n,), generator=g).tolist() for n in (4, 20, 9, 13, 6)]
    batch = Batch(left_padded(rows, tokenizer.pad_token_id))
    return model, batch.repeat_interleave(2)


def early_eos(model, batch, sampling, pad, seeds):
    """The token that, declared the EOS, ends the rows at the most different steps."""
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    free, _ = decode(model, ids, mask, sampling, -1, pad, row_seeds=seeds)
    rows = free.tolist()

    def ends(token):
        return {row.index(token) if token in row else len(row) for row in rows}

    return max({t for row in rows for t in row}, key=lambda t: len(ends(t)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_two_slots_give_the_tokens_and_log_probs_of_one_batch(prompts, tokenizer, temperature):
    model, batch = prompts
    pad = tokenizer.pad_token_id
    sampling = SamplingParams(12, temperature, top_k=3)
    seeds = list(range(100, 100 + len(batch)))
    eos = early_eos(model, batch, sampling, pad, seeds)
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    open_rows = {None: [], 2: []}
    runs = {
        slots: decode(
            model,
            ids,
            mask,
            sampling,
            eos,
            pad,
            slots=slots,
            on_step=open_rows[slots].append,
            log_probs=True,
            row_seeds=seeds,
        )
        for slots in (None, 2)
    }
    (whole, lp_whole), (two, lp_two) = runs[None], runs[2]
    lengths = response_mask_from_ids(whole, eos).sum(-1)
    assert len(set(lengths.tolist())) >= 2 and lengths.min() < 12  # rows end at different steps
    assert torch.equal(whole, two)
    response = response_mask_from_ids(two, eos).bool()
    assert (lp_whole - lp_two)[response].abs().max() < 1e-5
    # at most two rows decoded at once, and the batch shrank as rows ended
    assert max(open_rows[2]) == 2 and sum(open_rows[2]) == int(response.sum())
    assert sum(open_rows[None]) == int(response.sum()) and open_rows[None][-1] < len(batch)
    # the log-probs are a fresh forward's over each whole sequence
    forward, _ = response_log_probs(
        model, torch.cat([ids, two], 1), torch.cat([mask, response.long()], 1), two.shape[1], 1.0
    )
    assert (forward - lp_two)[response].abs().max() < 1e-5


def test_samples_do_not_depend_on_the_micro_batch(prompts, tokenizer):
    """`rollout.micro_batch_size` only bounds the rows decoded at once: each row samples from
    its own generator, seeded by its global index."""
    model, batch = prompts
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    sampling = SamplingParams(8, 1.0, seed=5, log_probs=True)
    outs = [HFRollout(model, pad, eos, m).generate(batch, sampling) for m in (3, len(batch))]
    assert torch.equal(outs[0]["response_ids"], outs[1]["response_ids"])
    # a part whose rows start at `row_offset` samples what those rows sample in the whole
    tail = Batch({k: v[4:] for k, v in batch.tensors.items()}, {}, {"row_offset": 4})
    part = HFRollout(model, pad, eos, 2).generate(tail, sampling)
    assert torch.equal(
        part["response_ids"], outs[1]["response_ids"][4:, : part["response_ids"].shape[1]]
    )


def test_without_joining_a_split_batch_samples_what_the_whole_one_does(prompts, tokenizer):
    """`join=False`: queued rows wait for the batch to empty, so the rows of a batch decoded
    in two parts (two ranks) meet the same neighbours, and come out bit-equal."""
    model, batch = prompts
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    sampling = SamplingParams(8, 1.0)
    seeds = list(range(len(batch)))
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    whole, lp = decode(
        model, ids, mask, sampling, eos, pad, slots=4, join=False, log_probs=True, row_seeds=seeds
    )
    for part in (slice(0, 4), slice(4, 8), slice(8, 10)):
        got, got_lp = decode(
            model, ids[part], mask[part], sampling, eos, pad, log_probs=True, row_seeds=seeds[part]
        )
        assert torch.equal(got, whole[part, : got.shape[1]])
        assert torch.equal(got_lp, lp[part, : got.shape[1]])
