"""The real path: SmolLM2-135M-Instruct from the packaged GGUF, one small GRPO step."""

import math

import torch

from hybrid_engine.config import load_config
from hybrid_engine.models import ensure_smollm2
from hybrid_engine.trainer import Engine


def test_smollm2_one_tiny_step():
    path = ensure_smollm2()
    assert (path / "model.safetensors").stat().st_size > 400e6
    cfg = load_config(
        "configs/demo_cpu.yaml",
        ["data.train_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=12",
         "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=4", "data.train_size=16",
         "data.val_size=4", "actor.optim.lr=1e-4", "reward.function=reward_fns:length_score",
         "reward.overlong_buffer_len=4"],
    )  # fmt: skip
    engine = Engine(cfg)
    assert engine.actor.policy.num_parameters() == 134_515_008
    before = engine.actor.policy.model.layers[0].mlp.up_proj.weight.detach().clone()
    batch = engine.reward(engine.rollout(1))
    texts = [engine.tokenizer.decode(r[m.bool()], skip_special_tokens=True)
             for r, m in zip(batch["response_ids"], batch["response_mask"], strict=True)]  # fmt: skip
    # A real instruct model answers in words, not random sub-tokens.
    assert sum(any(w in t.lower() for w in ("the", "is", "=", "answer")) for t in texts) >= 2, texts
    metrics = engine.update(engine.advantage(batch)).meta["metrics"]
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/entropy"] < 8
    assert not torch.equal(before, engine.actor.policy.model.layers[0].mlp.up_proj.weight)
    val = engine.validate()
    assert 0 <= val["val/accuracy"] <= 1
