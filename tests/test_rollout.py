import pytest
import torch

from hybrid_engine.config import ModelConfig
from hybrid_engine.data import prompt_batch
from hybrid_engine.models.loading import load_policy
from hybrid_engine.rollout.base import SamplingParams, response_mask_from_ids
from hybrid_engine.rollout.hf import HFRollout, _invert, decode, logits_warpers, sample_tokens


@pytest.mark.fast
def test_response_mask_keeps_first_eos_and_drops_the_rest():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 2, 2, 2]])
    assert response_mask_from_ids(ids, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


@pytest.fixture(scope="module")
def setup(tokenizer):
    model = load_policy(ModelConfig(path="tiny"), tokenizer, seed=0)
    questions = ["What is 1+1?", "Add 13 and 29, please, and explain.", "2-1?"]
    rows = [
        {
            "prompt": [{"role": "user", "content": q}],
            "data_source": "t",
            "reward_model": {"ground_truth": "1"},
            "extra_info": {},
        }
        for q in questions
    ]
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


@pytest.mark.parametrize("n", [1, 4])
def test_decode_greedy_gives_the_tokens_of_generate(setup, tokenizer, n):
    """Static cache, and with n > 1 each prompt prefilled once for its n samples: greedy
    decoding gives exactly `generate`'s tokens (pad after EOS, stopping when all rows ended)."""
    model, prompts = setup
    batch = prompts.repeat_interleave(n)  # left-padded prompts of different lengths
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    with torch.no_grad():
        full = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=eos,
        )
    counted = []
    ours, _ = decode(model, ids, mask, SamplingParams(10, 0.0), eos, pad, on_step=counted.append)
    assert torch.equal(ours, full[:, ids.shape[1] :])
    assert sum(counted) == int(response_mask_from_ids(ours, eos).sum())
    # declare row 0's latest first-seen token the EOS: row 0 ends there, padded after it
    row0 = ours[0].tolist()
    k = max(i for i in range(len(row0)) if row0[i] not in row0[:i])
    stopped, _ = decode(model, ids, mask, SamplingParams(10, 0.0), row0[k], pad)
    assert stopped[0, : k + 1].tolist() == row0[: k + 1] and (stopped[0, k + 1 :] == pad).all()


@pytest.mark.fast
def test_sample_tokens_draws_from_softmax_and_never_a_cut_token():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05, 0.0]])).expand(40_000, 6)
    torch.manual_seed(0)
    drawn = sample_tokens(logits, greedy=False)
    freq = torch.bincount(drawn, minlength=6).double() / len(drawn)
    expected = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0], dtype=torch.double)
    assert (freq - expected).abs().max() < 0.01, freq  # ~4 standard errors at most
    assert freq[5] == 0
    warp = logits_warpers(SamplingParams(4, temperature=1.0, top_k=2))
    cut = sample_tokens(warp(None, logits.clone()), greedy=False)
    assert set(cut.tolist()) == {0, 1}
    frac = float((cut == 0).double().mean())
    assert abs(frac - 0.5 / 0.7) < 0.01, frac
    assert sample_tokens(logits[:3], greedy=True).tolist() == [0, 0, 0]


@pytest.mark.fast
def test_sample_tokens_across_cdf_blocks():
    """A vocabulary of 700 (not a multiple of the 256-entry blocks) with its mass in three
    blocks: frequencies follow softmax, and tokens of probability 0 are never drawn."""
    probs = torch.zeros(700, dtype=torch.double)
    probs[5], probs[300], probs[650] = 0.3, 0.3, 0.2
    probs[100:200] = 0.2 / 100
    logits = probs.float().log().expand(40_000, 700)
    torch.manual_seed(1)
    freq = torch.bincount(sample_tokens(logits, greedy=False), minlength=700).double() / 40_000
    for token in (5, 300, 650):
        assert abs(freq[token] - probs[token]) < 0.01, (token, freq[token])
    assert abs(freq[100:200].sum() - 0.2) < 0.01
    assert freq[probs == 0].sum() == 0


@pytest.mark.fast
def test_inverting_a_cdf_never_lands_past_its_last_increment():
    """A draw that rounding puts at the CDF's total takes the last entry that adds
    probability, not a zero-probability entry after it."""
    cdf = torch.tensor([[0.1, 0.5, 0.5, 0.5], [0.2, 0.4, 0.7, 1.0]], dtype=torch.double)
    u = torch.tensor([[0.5], [0.3]], dtype=torch.double)
    assert _invert(cdf, u).tolist() == [1, 1]
