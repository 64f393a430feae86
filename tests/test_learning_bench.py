"""The learning benchmark's pure parts (bench/learning.py, bench/learning_report.py) and the
engine pieces it measures with: format-correct, the PPO band's clip fractions by side, the
held-out scorer of any policy."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from hybrid_engine.algorithms.losses import band_clip_fractions  # noqa: E402
from hybrid_engine.evaluation import group_shares  # noqa: E402
from hybrid_engine.rewards import format_correct  # noqa: E402

pytestmark = pytest.mark.fast


def test_group_shares_count_questions_with_some_and_with_all_samples_right():
    # k = 3: all right, one right, none right, two right (a partial score is not right)
    scores = [1, 1, 1, 0, 1, 0, 0, 0, 0.5, 1, 0, 1.0]
    assert group_shares(scores, 3) == (3 / 4, 2 / 4)
    assert group_shares([1, 0], 1) == (1 / 2, 0.0)  # one sample: never mixed


def test_format_correct_is_a_final_answer_the_scorer_can_read():
    assert format_correct("5 + 7 = 12")
    assert format_correct("The answer is -3.")
    assert format_correct("1,250")
    assert not format_correct("I cannot say.")
    assert not format_correct("")
    assert format_correct("so #### 42", "hashes")
    assert not format_correct("the answer is 42", "hashes")


def test_band_clip_fractions_by_side():
    old = torch.zeros(1, 5)
    # ratios 0.5, 0.5, 1.5, 1.5, 1.0 against advantages -1, +1, +1, -1, +1; last token masked
    logp = torch.log(torch.tensor([[0.5, 0.5, 1.5, 1.5, 1.0]]))
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    low, high = band_clip_fractions(old, logp, adv, mask, 0.2, 0.28)
    assert low.item() == pytest.approx(1 / 4)  # token 0 only: r < 0.8 with A < 0
    assert high.item() == pytest.approx(1 / 4)  # token 2 only: r > 1.28 with A > 0
    low, high = band_clip_fractions(old, logp, adv, mask, 0.2, 0.6)
    assert (low.item(), high.item()) == (pytest.approx(0.25), 0.0)


def test_over_seeds_mean_spread_and_t_interval():
    from learning_report import over_seeds

    s = over_seeds([0.4, 0.5, 0.6])
    assert s["n"] == 3 and s["mean"] == pytest.approx(0.5) and s["sd"] == pytest.approx(0.1)
    half = 4.302652729911275 * 0.1 / math.sqrt(3)  # t(0.975, 2 degrees of freedom)
    assert (s["low"], s["high"]) == (pytest.approx(0.5 - half), pytest.approx(0.5 + half))
    one = over_seeds([0.3])
    assert one == {"n": 1, "mean": 0.3, "sd": None, "low": None, "high": None}
    with pytest.raises(ValueError, match="no values"):
        over_seeds([])


def _run(framework, seed, curve, fmt=1.0):
    return {
        "framework": framework,
        "preset": "grpo",
        "seed": seed,
        "task": "basic_arithmetic",
        "questions": 500,
        "steps": 20,
        "wall_min": 10.0 + seed,
        "eval_min": 1.0,
        "machine": "cpu, 2 threads",
        "date": "2026-12-04",
        "commit": "abc1234",
        "evals": [
            {"step": s, "answer_correct": a, "format_correct": fmt}
            for s, a in zip((0, 10, 20), curve, strict=True)
        ],
        "per_step": [{"step": 1, "entropy": 1.0}, {"step": 2, "entropy": None}],
    }


def test_run_points_and_the_learning_table(tmp_path):
    from learning_report import plot, run_points, table

    r = _run("hybridrl", 1, (0.2, 0.5, 0.4))
    assert run_points(r) == {"before": 0.2, "best": 0.5, "final": 0.4}
    bad = {**r, "evals": r["evals"][1:]}
    with pytest.raises(ValueError, match="hybridrl grpo seed 1: no evaluation at step 0"):
        run_points(bad)
    runs = [r, _run("hybridrl", 2, (0.2, 0.3, 0.6), 0.5), _run("trl", 1, (0.2, 0.4, 0.4))]
    lines = table(runs).splitlines()
    assert len(lines) == 4  # header, rule, hybridrl, trl
    ours = lines[2].split(" | ")
    assert ours[1:5] == ["hybridrl", "basic_arithmetic", "1, 2", "500"]
    assert ours[5] == "20.0% ± 0.0 [20.0, 20.0]"  # before: 0.2 twice, no spread
    # best 0.5 and 0.6: mean 55, sd 7.1, t(0.975, 1) = 12.706 x 7.07 / sqrt(2) = 63.5
    assert ours[6] == "55.0% ± 7.1 [-8.5, 118.5]"
    assert ours[7].startswith("50.0% ± 14.1 [")  # final: 0.4 and 0.6
    assert ours[8].startswith("75.0% ± 35.4 [")  # final format-correct: 1.0 and 0.5
    assert ours[10] == "11.5 (1.0)"  # mean wall minutes of the two seeds (of it scoring)
    assert lines[3].split(" | ")[5:8] == ["20.0%", "40.0%", "40.0%"]  # one seed: no interval
    plot(runs, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_heldout_rows_are_distinct_and_unseen_in_training():
    from learning import config, heldout_rows

    from hybrid_engine.data import PromptData

    cfg = config("grpo", 1, 60, 1, ["data.train_size=200"])
    rows = heldout_rows(cfg, 300)
    questions = [json.dumps(r["prompt"], sort_keys=True) for r in rows]
    assert len(rows) == 300 and len(set(questions)) == 300
    seen = {json.dumps(r["prompt"], sort_keys=True) for r in PromptData(cfg.data).train}
    assert not seen & set(questions)
    with pytest.raises(ValueError, match="--val-size 25000: the preset has only"):
        heldout_rows(cfg, 25000)  # the task has ~20k distinct questions


def test_greedy_heldout_scores_a_policy_as_the_engine_validates(tiny_cfg):
    from hybrid_engine.engine import Engine
    from hybrid_engine.evaluation import greedy_heldout

    engine = Engine(tiny_cfg)
    own = engine.validate()
    got = greedy_heldout(engine.export()[0], engine.tokenizer, engine.data.val, tiny_cfg)
    assert got["questions"] == len(engine.data.val) > 0
    assert got["answer_correct"] == own["val/accuracy"]
    assert got["response_length"] == own["val/response_length/mean"]  # the same generations
    assert 0.0 <= got["answer_correct"] <= got["format_correct"] <= 1.0
