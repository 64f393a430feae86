import pytest
import torch

from hybrid_engine.config import ModelConfig
from hybrid_engine.data import prompt_batch
from hybrid_engine.models import load_policy
from hybrid_engine.rollout import HFRollout, SamplingParams, response_mask_from_ids


def test_response_mask_keeps_first_eos_and_drops_the_rest():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 2, 2, 2]])
    assert response_mask_from_ids(ids, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


@pytest.fixture(scope="module")
def setup(tokenizer):
    model = load_policy(ModelConfig(path="tiny"), tokenizer, seed=0)
    questions = ["What is 1+1?", "Add 13 and 29, please, and explain.", "2-1?"]
    rows = [{"prompt": [{"role": "user", "content": q}], "data_source": "t",
             "reward_model": {"ground_truth": "1"}, "extra_info": {}} for q in questions]  # fmt: skip
    return model, prompt_batch(rows, tokenizer, 256)


def test_generate_shapes_masks_and_n_samples(setup, tokenizer):
    model, prompts = setup
    rollout = HFRollout(model, tokenizer.pad_token_id, tokenizer.eos_token_id, micro_batch_size=4)
    batch = prompts.repeat_interleave(2)
    out = rollout.generate(batch, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    n, p = batch["prompt_ids"].shape
    assert out["response_ids"].shape == (n, 6) == out["response_mask"].shape
    assert out["input_ids"].shape == (n, p + 6)
    assert torch.equal(out["input_ids"][:, :p], batch["prompt_ids"])
    assert torch.equal(
        out["attention_mask"], torch.cat([batch["prompt_mask"], out["response_mask"]], 1)
    )
    assert (
        out.meta["gen_tokens"] == int(out["response_mask"].sum())
        and out.meta["gen_tokens_per_s"] > 0
    )
    same = rollout.generate(batch, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    assert torch.equal(same["response_ids"], out["response_ids"])


def test_greedy_is_deterministic_and_stops_at_eos(setup, tokenizer):
    model, prompts = setup
    pad = tokenizer.pad_token_id
    free = HFRollout(model, pad, eos_token_id=0, micro_batch_size=8).generate(
        prompts, SamplingParams(max_new_tokens=6, temperature=0.0)
    )
    assert free["response_mask"].all()  # token 0 is never produced: no early stop
    # Declare the token that first appears latest in a row (position k of row r) the EOS:
    # row r must stop right there, EOS included, and be padded after it.
    ids = free["response_ids"].tolist()
    r, k = max(
        ((r, k) for r in range(len(ids)) for k in range(5) if ids[r][k] not in ids[r][:k]),
        key=lambda rk: rk[1],
    )
    eos = ids[r][k]
    out = HFRollout(model, pad, eos, 8).generate(prompts, SamplingParams(6, temperature=0.0))
    assert out["response_mask"][r].tolist() == [1] * (k + 1) + [0] * (
        out["response_ids"].shape[1] - k - 1
    )
    assert out["response_ids"][r, k] == eos
    assert (out["response_ids"][r][out["response_mask"][r] == 0] == pad).all()
    assert torch.equal(out["response_ids"][r, : k + 1], free["response_ids"][r, : k + 1])


@pytest.mark.parametrize("greedy", [True, False])
def test_shared_prompt_prefill_generates_what_the_full_prefill_does(setup, tokenizer, greedy):
    """Each prompt's keys/values computed once and copied to its 4 samples: the same logits
    at every step (to float error) and, greedy, the same tokens as `generate` alone."""
    from hybrid_engine.rollout import shared_prompt_cache

    model, prompts = setup
    batch = prompts.repeat_interleave(4)  # left-padded prompts of different lengths
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=not greedy, top_k=None,
              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
              output_scores=True, return_dict_in_generate=True)  # fmt: skip
    outs = []
    for cache in (None, shared_prompt_cache(model, ids, mask)):
        torch.manual_seed(5)
        with torch.no_grad():
            outs.append(model.generate(input_ids=ids, cache=cache, **kw))
    full, shared = outs
    distinct = prompts["prompt_ids"], prompts["prompt_mask"]
    assert shared_prompt_cache(model, *distinct) is None  # nothing to share
    first = torch.stack(full.scores[:1]), torch.stack(shared.scores[:1])
    assert torch.allclose(*first, atol=1e-4), (first[0] - first[1]).abs().max()
    if greedy:
        assert torch.equal(full.sequences, shared.sequences)
