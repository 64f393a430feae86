"""The `vllm` rollout backend.

CPU tests cover the pure helpers (vLLM cannot be installed in the CPU environment, and the
engine is not imitated here). The GPU tests start a real vLLM engine on a tiny random Llama
and skip cleanly unless `vllm` is importable and CUDA is available.
"""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from hybrid_engine.batch import Batch
from hybrid_engine.config import ModelConfig, TinyModelConfig
from hybrid_engine.rollout.base import SamplingParams
from hybrid_engine.rollout.vllm import (
    VLLMRollout,
    assemble_outputs,
    sampled_logprobs,
    strip_left_padding,
    vllm_sampling_kwargs,
    weight_buckets,
)

# head_dim 64 (256 / 4 heads): every vLLM attention backend takes it
VLLM_TINY = ModelConfig(tiny=TinyModelConfig(hidden_size=256, intermediate_size=512))
HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not (HAS_VLLM and HAS_GPU), reason="needs vllm and a CUDA GPU")


# ------------------------------------------------------------------------------- pure helpers
def test_strip_left_padding_keeps_masked_tokens_even_if_they_equal_pad():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1], [0, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    assert strip_left_padding(ids, mask) == [[5, 6], [7, 8, 9, 1], [0, 0]]


def test_strip_left_padding_rejects_empty_rows_and_bad_shapes():
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        strip_left_padding(torch.tensor([[3, 4], [0, 0]]), torch.tensor([[1, 1], [0, 0]]))
    with pytest.raises(ValueError, match="same shape"):
        strip_left_padding(torch.tensor([[3, 4]]), torch.tensor([[1, 1, 1]]))


def test_assemble_outputs_pads_masks_through_first_eos_and_zeroes_padding():
    pad, eos = 0, 2
    ids, mask, logp = assemble_outputs(
        [[5, 2, 9], [7, 8, 6, 4], [2]],
        [[-0.5, -0.25, -3.0], [-1.0, -2.0, -0.125, -4.0], [-0.75]],
        pad,
        eos,
    )
    assert ids.tolist() == [[5, 2, 0, 0], [7, 8, 6, 4], [2, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert logp.tolist() == [[-0.5, -0.25, 0, 0], [-1.0, -2.0, -0.125, -4.0], [-0.75, 0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long and logp.dtype == torch.float32


def test_assemble_outputs_with_pad_equal_to_eos_never_counts_padding():
    # A row cut short without EOS (e.g. by the model's context length) must not gain a token.
    ids, mask, logp = assemble_outputs(
        [[3], [3, 4, 5], [6, 2]], [[-1.0], [-1.0] * 3, [-1.0] * 2], 2, 2
    )
    assert ids.tolist() == [[3, 2, 2], [3, 4, 5], [6, 2, 2]]
    assert mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0]]
    assert logp.tolist() == [[-1.0, 0, 0], [-1.0, -1.0, -1.0], [-1.0, -1.0, 0]]


def test_assemble_outputs_edge_cases():
    ids, mask, logp = assemble_outputs([], [], 0, 2)
    assert ids.shape == mask.shape == logp.shape == (0, 0)
    with pytest.raises(ValueError, match="row 0: 2 tokens but 1 log-probs"):
        assemble_outputs([[1, 2]], [[-1.0]], 0, 2)
    with pytest.raises(ValueError, match="2 token rows but 1 log-prob rows"):
        assemble_outputs([[1], [2]], [[-1.0]], 0, 2)


def test_vllm_sampling_kwargs_seeds_follow_global_rows():
    sp = SamplingParams(max_new_tokens=7, temperature=0.8, top_p=0.9, top_k=0, seed=100)
    kws = vllm_sampling_kwargs(sp, eos_token_id=2, row_offset=6, num_rows=3)
    assert [k["seed"] for k in kws] == [106, 107, 108]
    assert kws[0] == {
        "n": 1,
        "max_tokens": 7,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "logprobs": 0,
        "detokenize": False,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 106,
    }  # top_k=0 (off) is left to vLLM's default
    # The same rows from an unsplit batch get the same seeds.
    whole = vllm_sampling_kwargs(sp, 2, 0, 9)
    assert [k["seed"] for k in whole[6:]] == [106, 107, 108]
    assert vllm_sampling_kwargs(SamplingParams(5, top_k=20), 2, 0, 1)[0]["top_k"] == 20


def test_vllm_sampling_kwargs_greedy_has_no_seed():
    kws = vllm_sampling_kwargs(SamplingParams(4, temperature=0.0, seed=9), 2, 3, 2)
    assert all(k["temperature"] == 0.0 and "seed" not in k and "top_p" not in k for k in kws)
    assert len(kws) == 2 and kws[0]["max_tokens"] == 4


def test_sampled_logprobs_reads_the_sampled_token():
    lp = SimpleNamespace
    steps = [{5: lp(logprob=-0.5), 9: lp(logprob=-3.0)}, {2: lp(logprob=-0.25)}]
    assert sampled_logprobs([5, 2], steps) == [-0.5, -0.25]
    assert sampled_logprobs([5, 2], None) == [0.0, 0.0]


def test_weight_buckets_split_by_bytes_and_copy_to_cpu_only_when_asked():
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(16)  # 16, 16, 64 bytes
    named = [("a", a), ("b", b), ("c", c)]
    buckets = list(weight_buckets(named, max_bytes=32, to_cpu=False))
    assert [[n for n, _ in bk] for bk in buckets] == [["a", "b"], ["c"]]
    assert buckets[0][0][1].data_ptr() == a.data_ptr()  # passed by reference
    copied = list(weight_buckets(named, max_bytes=10**6, to_cpu=True))
    assert len(copied) == 1 and copied[0][2][1].data_ptr() != c.data_ptr()
    assert torch.equal(copied[0][2][1], c)


@pytest.mark.skipif(HAS_VLLM and HAS_GPU, reason="vllm and a GPU are present")
def test_missing_vllm_or_gpu_names_the_setting():
    with pytest.raises(RuntimeError, match="rollout.name=vllm"):
        VLLMRollout("/nonexistent", tensor_parallel_size=1, pad_token_id=0, eos_token_id=2)


# --------------------------------------------------------------------------------- GPU tests
@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    """One engine for all GPU tests (vLLM allows one sleep-mode engine per process)."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hybrid_engine.models.loading import save_tiny_model

    path = tmp_path_factory.mktemp("tiny_llama")
    model = save_tiny_model(VLLM_TINY, tokenizer, path, seed=0, initializer_range=0.1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rollout = VLLMRollout(
        str(path),
        tensor_parallel_size=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        max_model_len=1024,
    )
    return rollout, state


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from hybrid_engine.data import prompt_batch

    questions = ["What is 1+1?", "Add 13 and 29, please, and explain.", "2-1?", "Name a color."]
    rows = [
        {
            "prompt": [{"role": "user", "content": q}],
            "data_source": "t",
            "reward_model": {"ground_truth": "1"},
            "extra_info": {},
        }
        for q in questions
    ]
    return prompt_batch(rows, tokenizer, 256)


def greedy(rollout: VLLMRollout, batch: Batch, n: int = 8) -> list[list[int]]:
    out = rollout.generate(batch, SamplingParams(n, temperature=0.0))
    rows = zip(out["response_ids"], out["response_mask"], strict=True)
    return [r[m.bool()].tolist() for r, m in rows]


@gpu
def test_gpu_generate_contract(engine, prompts):
    rollout, _ = engine
    batch = prompts.repeat_interleave(2)
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    out = rollout.generate(batch, sp)
    n, p = batch["prompt_ids"].shape
    r = out["response_ids"].shape[1]
    assert 1 <= r <= 8 and out["response_mask"].shape == out["rollout_log_probs"].shape == (n, r)
    assert torch.equal(out["input_ids"][:, :p], batch["prompt_ids"])
    assert torch.equal(
        out["attention_mask"], torch.cat([batch["prompt_mask"], out["response_mask"]], 1)
    )
    valid = out["response_mask"].bool()
    lp = out["rollout_log_probs"]
    assert torch.isfinite(lp).all() and (lp[valid] <= 0).all() and (lp[~valid] == 0).all()
    assert out.meta["gen_tokens"] == int(valid.sum()) and out.meta["gen_tokens_per_s"] > 0
    again = rollout.generate(batch, sp)
    assert torch.equal(again["response_ids"], out["response_ids"])  # per-row seeds


@gpu
def test_gpu_greedy_stops_at_eos_and_keeps_it(engine, prompts, tokenizer):
    rollout, _ = engine
    free = VLLMRollout.from_engine(rollout.llm, rollout._sampling_params_cls, 0, eos_token_id=0)
    ids = greedy(free, prompts, 6)
    assert all(len(row) == 6 for row in ids)  # token 0 is never produced: no early stop
    r, k = max(
        ((r, k) for r in range(len(ids)) for k in range(5) if ids[r][k] not in ids[r][:k]),
        key=lambda rk: rk[1],
    )
    eos = ids[r][k]
    stop = VLLMRollout.from_engine(rollout.llm, rollout._sampling_params_cls, 0, eos)
    out = stop.generate(prompts, SamplingParams(6, temperature=0.0))
    width = out["response_ids"].shape[1]
    assert out["response_mask"][r].tolist() == [1] * (k + 1) + [0] * (width - k - 1)
    assert out["response_ids"][r, : k + 1].tolist() == ids[r][: k + 1]


@gpu
def test_gpu_load_weights_in_place_changes_and_restores_greedy_outputs(engine, prompts):
    rollout, state = engine
    before = greedy(rollout, prompts)
    gen = torch.Generator().manual_seed(1)
    noisy = {k: v + torch.randn(v.shape, generator=gen) * v.float().std() for k, v in state.items()}
    try:
        rollout.sleep()
        assert rollout.load_weights(noisy.items()) == len(state)  # loaded while asleep
        assert not rollout.sleeping
        assert greedy(rollout, prompts) != before
    finally:
        assert rollout.load_weights(state.items()) == len(state)  # loaded while awake
    assert greedy(rollout, prompts) == before


@gpu
def test_gpu_sleep_frees_memory_and_wake_restores_outputs(engine, prompts):
    rollout, _ = engine
    before = greedy(rollout, prompts)
    free_awake = torch.cuda.mem_get_info()[0]
    rollout.sleep()
    free_asleep = torch.cuda.mem_get_info()[0]
    assert free_asleep - free_awake > 2**30  # at least the KV cache (30% of the GPU) goes
    rollout.wake_up()
    assert greedy(rollout, prompts) == before
