import numpy as np
import pytest
import torch

from flows.cli.preflight import probe_reward
from hybrid_engine.config import load_config
from hybrid_engine.data import PromptData
from hybrid_engine.rewards import (
    RewardError,
    RewardScorer,
    extract_answer,
    numeric_match,
    token_level_scores,
)

pytestmark = pytest.mark.fast  # the inner loop: bash scripts/test.sh -m fast


def test_extract_answer():
    assert extract_answer("5 + 7 = 12. So the answer is 12.") == "12"
    assert extract_answer("It is -3") == "-3"
    assert extract_answer("1,234 apples") == "1234"
    assert extract_answer("no digits") is None
    assert extract_answer("x = 4 #### 42 done", "hashes") == "42"
    assert extract_answer("x = 4", "hashes") is None


def test_numeric_match():
    assert numeric_match("12", "12") == 1.0
    assert numeric_match("12.0", "12") == 1.0
    assert numeric_match("13", "12") == 0.0
    assert numeric_match(None, "12") == 0.0
    assert numeric_match("abc", "abc") == 1.0


def rows(truths, source="file.jsonl", entries=None):
    return [
        {"data_source": source, "ground_truth": t, "extra_info": {"rg_entry": e} if e else {}}
        for t, e in zip(truths, entries or [None] * len(truths), strict=True)
    ]


def test_builtin_rule_and_reasoning_gym_scorer():
    s = RewardScorer(None, "last_number", {})
    assert s.score(["p", "p"], ["the sum is 7", "8"], rows(["7", "7"])) == [1.0, 0.0]
    entry = {"question": "Calculate 5 - 3.", "answer": "2", "metadata": {}}
    rg_rows = rows(["2", "2"], "reasoning_gym:basic_arithmetic", [entry, entry])
    assert s.score(["p", "p"], ["5 - 3 = 2", "it is 3"], rg_rows) == [1.0, 0.0]


def test_user_function_and_its_errors():
    ok = RewardScorer("reward_fns:length_score", "last_number", {})
    assert ok.score(["p"], ["abcd"], rows(["1"])) == [0.04]
    bad = RewardScorer("reward_fns:fails_on_x", "last_number", {})
    with pytest.raises(RewardError, match="sample 1 .*cannot score x"):
        bad.score(["p", "p", "p"], ["a", "b", "c"], rows(["1", "x", "2"]))
    with pytest.raises(RewardError, match="sample 1 is nan"):
        RewardScorer("reward_fns:returns_nan", "last_number", {}).score(
            ["p", "p"], ["a", "b"], rows(["1", "2"])
        )
    with pytest.raises(RewardError, match="sample 0 is None"):
        RewardScorer("reward_fns:returns_none", "last_number", {}).score(["p"], ["a"], rows(["1"]))
    with pytest.raises(RewardError, match="1 scores for 2 samples"):
        RewardScorer("reward_fns:returns_too_few", "last_number", {}).score(
            ["p", "p"], ["a", "b"], rows(["1", "2"])
        )
    with pytest.raises(ValueError, match="module:function"):
        RewardScorer("no_colon", "last_number", {})
    with pytest.raises(ValueError, match="cannot be loaded"):
        RewardScorer("reward_fns:missing", "last_number", {})


def test_score_sits_on_last_response_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    out = token_level_scores([0.5, 1.0, -2.0], mask)
    assert out.tolist() == [[0, 0, 0.5, 0], [1.0, 0, 0, 0], [0, 0, 0, -2.0]]


def test_overlong_penalty_is_dapos_linear_ramp():
    from hybrid_engine.rewards import overlong_penalty

    lengths = torch.tensor([4, 24, 26, 28, 32])
    # max 32, buffer 8: free up to 24 tokens, then -0.5 * (L - 24) / 8
    out = overlong_penalty(lengths, max_len=32, buffer_len=8, factor=0.5)
    assert out.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty(lengths, 32, 0, 1.0).tolist() == [0.0] * 5


def test_numpy_torch_and_bool_scores_are_trained_as_the_same_float():
    s = RewardScorer("reward_fns:returns_numpy", "last_number", {})
    got = s.score(["p"] * 6, ["a"] * 6, rows(["1"] * 6))
    assert got == [float(np.float32(0.1)), 2.0, 1.0, 0.75, 0.0, 1.0]
    assert all(type(x) is float for x in got)
    # the check when the config is read takes them too
    cfg = load_config("configs/grpo_tiny.yaml", ["reward.function=reward_fns:returns_numpy"])
    probe_reward(cfg, PromptData(cfg.data))


def test_non_finite_and_non_number_scores_name_the_sample():
    with pytest.raises(RewardError, match="sample 1 is inf"):
        RewardScorer("reward_fns:returns_inf", "last_number", {}).score(
            ["p", "p"], ["a", "b"], rows(["1", "2"])
        )
    with pytest.raises(RewardError, match="sample 0 is '1.0'"):
        RewardScorer("reward_fns:returns_text", "last_number", {}).score(["p"], ["a"], rows(["1"]))
