"""The `hf` rollout's KV prefix cache: a second turn that prefills only its new tokens gives the
tokens and log-probs of a fresh prefill of the whole context; the cache's LRU budget, its
longest-prefix match and its drop when the weights change."""

import pytest
import torch

from hybrid_engine.batch import Batch
from hybrid_engine.config import ModelConfig, OptimConfig
from hybrid_engine.models.loading import load_policy
from hybrid_engine.models.logprobs import response_log_probs
from hybrid_engine.roles.updates import make_optimizer
from hybrid_engine.rollout.base import SamplingParams
from hybrid_engine.rollout.hf import HFRollout
from hybrid_engine.rollout.multiturn import left_padded
from hybrid_engine.rollout.prefix_cache import PrefixCache

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def model(tokenizer):
    return load_policy(ModelConfig(path="tiny"), tokenizer, seed=0)


def two_turns(rollout, tokenizer, sampling):
    """Turn 1 on three prompts (two samples of the first), then turn 2 on each context plus
    its response plus an observation of different length per row."""
    prompts = [
        tokenizer("What is 1+1?")["input_ids"],
        tokenizer("What is 1+1?")["input_ids"],
        tokenizer("Add 13 and 29, please, and explain.")["input_ids"],
        tokenizer("2-1?")["input_ids"],
    ]
    first = rollout.generate(Batch(left_padded(prompts, tokenizer.pad_token_id)), sampling)
    contexts = []
    for i, p in enumerate(prompts):
        n = int(first["response_mask"][i].sum())
        observation = tokenizer(" too high" * (i + 1))["input_ids"]
        contexts.append(p + first["response_ids"][i, :n].tolist() + observation)
    second = rollout.generate(
        Batch(left_padded(contexts, tokenizer.pad_token_id)),
        SamplingParams(
            **{**sampling.__dict__, "keep_prefixes": False, "reuse_prefixes": True, "seed": 7}
        ),
    )
    return first, second


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_second_turn_from_the_cache_equals_a_fresh_prefill(model, tokenizer, temperature):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    sampling = SamplingParams(8, temperature, seed=3, log_probs=True, keep_prefixes=True)
    cached = HFRollout(model, pad, eos, micro_batch_size=8, prefix_cache_mb=64)
    fresh = HFRollout(model, pad, eos, micro_batch_size=8, prefix_cache_mb=0)
    first_c, second_c = two_turns(cached, tokenizer, sampling)
    first_f, second_f = two_turns(fresh, tokenizer, sampling)

    assert torch.equal(first_c["response_ids"], first_f["response_ids"])  # nothing cached yet
    assert torch.equal(second_c["response_ids"], second_f["response_ids"])
    mask = second_c["response_mask"].bool()
    lp_c, lp_f = second_c["rollout_log_probs"], second_f["rollout_log_probs"]
    assert (lp_c - lp_f)[mask].abs().max() < 1e-5
    # ... and equal to the training side's forward over the whole sequence
    forward, _ = response_log_probs(
        model, second_c["input_ids"], second_c["attention_mask"], mask.shape[1], 1.0
    )
    if temperature:
        assert (forward - lp_c)[mask].abs().max() < 1e-5

    # turn 2 took every context token but the last from the cache, except the
    # observation: hits = prompt + response of each row; lookups = the whole contexts
    assert first_c.meta["prefix_hit_tokens"] == 0
    lookups = int(second_c["prompt_mask"].sum())
    assert second_c.meta["prefix_lookup_tokens"] == lookups
    assert 0 < second_c.meta["prefix_hit_tokens"] < lookups
    assert "prefix_hit_tokens" not in first_f.meta  # off: no lookups at all
    assert len(cached.prefixes) == 0  # the second call kept nothing: the memory is freed


def test_an_optimizer_step_drops_the_cache(model, tokenizer):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    rollout = HFRollout(model, pad, eos, micro_batch_size=8, prefix_cache_mb=64)
    prompt = Batch(left_padded([tokenizer("What is 1+1?")["input_ids"]], pad))
    rollout.generate(prompt, SamplingParams(4, 0.0, keep_prefixes=True))
    assert len(rollout.prefixes) == 1
    rollout.prefixes.check_weights(model)
    assert len(rollout.prefixes) == 1  # same weights: kept
    params = [p for p in model.parameters()]
    saved = [p.detach().clone() for p in params]
    opt, _ = make_optimizer(params, OptimConfig(lr=1e-3))  # the roles' fused AdamW
    model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)
    opt.step()
    rollout.prefixes.check_weights(model)
    assert len(rollout.prefixes) == 0
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)


def test_a_call_that_does_not_continue_starts_from_an_empty_cache(model, tokenizer):
    """What a rollout samples never depends on what ran before it in the process (a resumed
    run has not run it): only a call marked as a continuation reuses kept prefixes."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    rollout = HFRollout(model, pad, eos, micro_batch_size=8, prefix_cache_mb=64)
    prompt = Batch(left_padded([tokenizer("What is 1+1? Say it twice.")["input_ids"]], pad))
    keep = SamplingParams(4, 0.0, keep_prefixes=True)
    rollout.generate(prompt, keep)
    assert rollout.generate(prompt, keep).meta["prefix_hit_tokens"] == 0
    again = rollout.generate(prompt, SamplingParams(4, 0.0, reuse_prefixes=True))
    assert again.meta["prefix_hit_tokens"] == len(prompt["prompt_ids"][0]) - 1


def test_lru_budget_longest_prefix_and_extension():
    kv = lambda n: torch.zeros(2, 2, 1, n, 4)  # noqa: E731  2 layers, 1 head, dim 4: 64 B/token
    cache = PrefixCache(budget_bytes=64 * 10)
    ids = torch.tensor
    cache.put(ids([1, 2, 3, 4]), kv(4))
    cache.put(ids([1, 2, 9]), kv(3))
    entry, n = cache.match(ids([1, 2, 3, 7, 7]))
    assert n == 3 and entry.ids.tolist() == [1, 2, 3, 4]
    entry, n = cache.match(ids([1, 2, 3, 4]))  # the last token is left to prefill
    assert n == 3
    assert cache.match(ids([5, 1]))[1] == 0
    cache.put(ids([1, 2, 9, 9, 9]), kv(5))  # extends [1, 2, 9]: that entry goes
    assert sorted(len(e.ids) for e in cache.entries.values()) == [4, 5]
    cache.put(ids([6, 6]), kv(2))  # 11 tokens > 10: the least recently used goes
    assert [e.ids.tolist() for e in cache.entries.values()] == [[1, 2, 9, 9, 9], [6, 6]]
    assert cache.nbytes == 64 * 7
    cache.put(ids(list(range(20))), kv(20))  # larger than the budget: not stored
    assert cache.nbytes == 64 * 7
    assert cache.reused == 6 and cache.looked_up == 5 + 4 + 2
