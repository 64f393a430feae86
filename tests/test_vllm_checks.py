"""The `vllm` rollout backend without an engine: its pure helpers, and what is checked
before an engine starts (the fast tier). Real engines: test_rollout_vllm.py."""

import pytest
import torch

from hybrid_engine.config import load_config
from hybrid_engine.models.sharding import engine_weights
from hybrid_engine.pool.dispatch import mean_metrics
from hybrid_engine.rollout import vllm_env
from hybrid_engine.rollout.base import SamplingParams
from hybrid_engine.rollout.vllm import (
    assemble_outputs,
    bind_count,
    check_engine,
    engine_model_dir,
    strip_left_padding,
    vllm_sampling_kwargs,
)
from hybrid_engine.step_metrics import gap_metrics, gap_summary

VLLM = ["rollout.name=vllm"]


# ------------------------------------------------------------------------------- pure helpers
@pytest.mark.fast
def test_strip_left_padding_keeps_masked_tokens_even_if_they_equal_pad():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1], [0, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    assert strip_left_padding(ids, mask) == [[5, 6], [7, 8, 9, 1], [0, 0]]
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        strip_left_padding(torch.tensor([[3, 4], [0, 0]]), torch.tensor([[1, 1], [0, 0]]))


@pytest.mark.fast
def test_assemble_outputs_pads_masks_through_first_eos_and_zeroes_padding():
    ids, mask, logp = assemble_outputs(
        [[5, 2, 9], [7, 8, 6, 4], [2]],
        [[-0.5, -0.25, -3.0], [-1.0, -2.0, -0.125, -4.0], [-0.75]],
        0,
        2,
    )
    assert ids.tolist() == [[5, 2, 0, 0], [7, 8, 6, 4], [2, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert logp.tolist() == [[-0.5, -0.25, 0, 0], [-1.0, -2.0, -0.125, -4.0], [-0.75, 0, 0, 0]]
    with pytest.raises(ValueError, match="row 0: 2 tokens but 1 log-probs"):
        assemble_outputs([[1, 2]], [[-1.0]], 0, 2)


@pytest.mark.fast
def test_threads_bind_is_counted_and_a_bad_list_is_refused_naming_the_key():
    assert [bind_count(s) for s in ("0-1", "0,2-3", "5")] == [2, 3, 1]
    one = load_config("configs/grpo_tiny.yaml", [*VLLM, "rollout.vllm.threads_bind=5"])
    assert one.rollout.vllm.threads_bind == "5"
    with pytest.raises(ValueError, match="rollout.vllm.threads_bind='all'"):
        load_config("configs/grpo_tiny.yaml", [*VLLM, "rollout.vllm.threads_bind=all"])
    with pytest.raises(ValueError, match="rollout.vllm.threads_bind='3-1'"):
        load_config("configs/grpo_tiny.yaml", [*VLLM, "rollout.vllm.threads_bind=3-1"])


@pytest.mark.fast
def test_sampling_kwargs_seed_each_row_by_its_global_index():
    sp = SamplingParams(max_new_tokens=7, temperature=0.8, seed=100)
    kws = vllm_sampling_kwargs(sp, eos_token_id=2, row_offset=6, num_rows=3)
    assert [k["seed"] for k in kws] == [106, 107, 108]
    assert kws[0]["logprobs"] == 0 and kws[0]["stop_token_ids"] == [2]
    greedy = vllm_sampling_kwargs(SamplingParams(4, temperature=0.0, seed=9), 2, 3, 2)
    assert all(k["temperature"] == 0.0 and "seed" not in k for k in greedy)


@pytest.mark.fast
def test_engine_weights_push_the_tied_lm_head_under_its_own_name(tiny_cfg, tokenizer):
    from hybrid_engine.models.loading import load_policy

    model = load_policy(tiny_cfg.model, tokenizer, 0)
    names, arrays = engine_weights(model)
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    lm, emb = names.index("lm_head.weight"), names.index("model.embed_tokens.weight")
    assert (arrays[lm] == arrays[emb]).all() and arrays[lm].dtype == "float32"
    assert all(type(a).__module__ == "numpy" for a in arrays)  # plain data, not torch


@pytest.mark.fast
def test_gap_metrics_and_their_merge_over_ranks():
    """The gap over the masked tokens, the same when gathered micro-batch by micro-batch;
    over the ranks the means average and the maxima take the largest."""
    mask = torch.tensor([[1, 1, 0]])
    m = gap_metrics(torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[-1.5, -2.0, 0.0]]), mask)
    assert m == {"rollout/logprob_gap_mean": 0.25, "rollout/logprob_gap_max": 0.5}
    assert gap_summary([torch.tensor([0.5]), torch.tensor([0.0])]) == m
    assert gap_summary([]) == {}
    other = {"rollout/logprob_gap_mean": 0.75, "rollout/logprob_gap_max": 0.75, "a/x": 1.0}
    assert mean_metrics([m | {"a/x": 0.0}, other]) == {
        "rollout/logprob_gap_mean": 0.5,
        "rollout/logprob_gap_max": 0.75,
        "a/x": 0.5,
    }


# ------------------------------------------------------- checked before an engine starts
@pytest.mark.fast
def test_the_tiny_models_engine_folder_is_written_once(tmp_path, tokenizer, monkeypatch):
    from hybrid_engine.models.loading import load_policy

    monkeypatch.setenv("HYBRIDRL_CACHE", str(tmp_path))
    cfg = load_config("configs/grpo_tiny.yaml", ["rollout.name=vllm"])
    model = load_policy(cfg.model, tokenizer, 0)
    first = engine_model_dir(cfg, model, tokenizer)
    assert (first / "model.safetensors").is_file()
    assert engine_model_dir(cfg, model, tokenizer) == first  # found again after the save
    assert [p.name for p in first.parent.iterdir()] == [first.name]


@pytest.mark.fast
def test_head_dim_kv_size_and_model_path_are_refused_before_an_engine_starts(tmp_path, tokenizer):
    from hybrid_engine.models.loading import load_policy

    cfg = load_config("configs/grpo_tiny.yaml", ["rollout.name=vllm"])
    model_dir = engine_model_dir(cfg, load_policy(cfg.model, tokenizer, 0), tokenizer)
    assert check_engine(cfg, model_dir) == 256 + 8  # prompt + response
    four = load_config(None, ["rollout.name=vllm"])  # the tiny model's default: 4 heads of 16
    four_dir = engine_model_dir(four, load_policy(four.model, tokenizer, 0), tokenizer)
    with pytest.raises(ValueError, match=r"model.tiny.num_attention_heads: head_dim=16"):
        check_engine(four, four_dir)
    small = load_config(
        "configs/grpo_tiny.yaml", ["rollout.name=vllm", "rollout.vllm.kv_cache_gb=0"]
    )
    with pytest.raises(ValueError, match=r"rollout.vllm.kv_cache_gb=0 holds 0 tokens"):
        check_engine(small, model_dir)
    short = load_config(
        "configs/grpo_tiny.yaml", ["rollout.name=vllm", "rollout.vllm.max_model_len=100"]
    )
    with pytest.raises(ValueError, match=r"rollout.vllm.max_model_len=100 is shorter"):
        check_engine(short, model_dir)
    bad = load_config(None, ["rollout.name=vllm", f"model.path={tmp_path}/none"])
    with pytest.raises(FileNotFoundError, match=r"model.path=.*/none' is not a Hugging Face"):
        engine_model_dir(bad, None, tokenizer)


@pytest.mark.fast
def test_an_environment_not_built_is_one_line_naming_the_script(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDRL_CACHE", str(tmp_path))
    monkeypatch.delenv(vllm_env.PYTHON_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"not built .*run `bash scripts/setup_vllm.sh`"):
        vllm_env.python()
    assert vllm_env.venv_dir().parent == tmp_path
    assert any(p.startswith("ray==") for p in vllm_env.pins())  # the main venv's ray
