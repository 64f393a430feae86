"""The real path: SmolLM2-135M-Instruct from the packaged GGUF, one small GRPO step."""

import math
import re

import pytest
import torch

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.models.loading import ensure_smollm2


def test_smollm2_one_tiny_step():
    path = ensure_smollm2()
    assert (path / "model.safetensors").stat().st_size > 400e6
    cfg = load_config(
        "configs/demo_cpu.yaml",
        [
            "data.train_batch_size=2",
            "rollout.n=2",
            "rollout.max_new_tokens=12",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size=4",
            "data.train_size=16",
            "data.val_size=4",
            "actor.optim.lr=1e-4",
            "reward.function=reward_fns:length_score",
            "reward.overlong_buffer_len=4",
        ],
    )
    engine = Engine(cfg)
    assert engine.actor.policy.num_parameters() == 134_515_008
    before = engine.actor.policy.model.layers[0].mlp.up_proj.weight.detach().clone()
    batch = engine.reward(engine.rollout(1))
    texts = [
        engine.tokenizer.decode(r[m.bool()], skip_special_tokens=True)
        for r, m in zip(batch["response_ids"], batch["response_mask"], strict=True)
    ]
    # A real instruct model answers in English words, not random sub-tokens: common English
    # words (the most frequent ones), not an equation (which a prompt's numbers and "=" would
    # make of any output).
    english = set(
        "the be to of and a in that have i it for not on with he as you do at this but his by "  # noqa: SIM905
        "from they we say her she or an will my one all would there their what so up out if "
        "about who get which go me is are".split()
    )
    assert sum(len(set(re.findall(r"[a-z]+", t.lower())) & english) >= 2 for t in texts) >= 2, texts
    metrics = engine.update(engine.advantage(batch)).meta["metrics"]
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/entropy"] < 8
    assert not torch.equal(before, engine.actor.policy.model.layers[0].mlp.up_proj.weight)
    # validation scores the greedy answers to the 4 held-out questions with the run's reward
    # function (length_score: characters / 100); accuracy is the share that scored 1
    val = engine.validate(samples=4)
    shown = val.pop("_samples")
    assert len(shown) == 4 and all(s["response"] for s in shown), shown
    scores = [len(s["response"]) / 100 for s in shown]
    assert [s["score"] for s in shown] == pytest.approx(scores)
    assert val["val/score/mean"] == pytest.approx(sum(scores) / 4)
    assert val["val/accuracy"] == sum(s >= 1 for s in scores) / 4
