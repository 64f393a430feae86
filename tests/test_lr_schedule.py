"""The LR schedule: warm-up, then constant or a decay (linear, cosine) to min_lr_ratio x lr
over the run's optimizer steps; a warm pool built for another schedule length is not reused."""

import math

import pytest

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.pool.worker import pool_spec, spec_diff
from hybrid_engine.roles.updates import lr_factor

PRESET = "configs/grpo_tiny.yaml"  # 16 samples per step, mini-batches of 8: 2 optimizer steps


@pytest.mark.fast
def test_lr_factor_warms_up_then_holds_or_decays_to_the_floor():
    # warm-up: the first optimizer step already trains, at lr / warmup
    assert [lr_factor(s, 4, 0, "constant", 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1, 1, 1]
    linear = [lr_factor(s, 1, 5, "linear", 0.1) for s in range(6)]
    assert linear == pytest.approx([1.0, 1.0, 0.7, 0.4, 0.1, 0.1])  # the last step at the floor
    cosine = [lr_factor(s, 0, 5, "cosine", 0.0) for s in range(5)]
    assert cosine == pytest.approx([1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, 0.1464466, 0.0])
    assert lr_factor(3, 0, 1, "cosine", 0.0) == 1.0  # a one-step run has nothing to decay over


@pytest.mark.fast
def test_optimizer_steps_count_trainer_steps_mini_batches_and_epochs():
    cfg = load_config(PRESET, ["trainer.total_training_steps=3", "actor.ppo_epochs=2"])
    assert cfg.optimizer_steps(cfg.actor) == 3 * 2 * 2
    with pytest.raises(ValueError, match="lr_schedule"):
        load_config(PRESET, ["actor.optim.lr_schedule=step"])


@pytest.mark.fast
def test_a_pool_spec_holds_the_schedule_length_only_where_the_lr_decays():
    spec = {
        n: pool_spec(load_config(PRESET, [f"trainer.total_training_steps={n}"])) for n in (2, 3)
    }
    assert spec_diff(spec[2], spec[3]) == []  # constant: any run length reuses the pool
    linear = ["actor.optim.lr_schedule=linear"]
    a, b = (
        pool_spec(load_config(PRESET, [*linear, f"trainer.total_training_steps={n}"]))
        for n in (2, 3)
    )
    assert spec_diff(a, b) == ["actor.optim"]


@pytest.mark.fast
def test_training_logs_the_decaying_lr():
    """Two trainer steps of two optimizer steps each, linear from 1e-3 to 1e-4: factors 1,
    0.7, 0.4, 0.1; each step logs its optimizer steps' mean LR."""
    cfg = load_config(
        PRESET,
        [
            "reward.function=reward_fns:length_score",
            "actor.optim.lr_schedule=linear",
            "actor.optim.min_lr_ratio=0.1",
        ],
    )
    engine = Engine(cfg)
    lrs = [engine.step(s)["actor/lr"] for s in (1, 2)]
    assert lrs == pytest.approx([0.85e-3, 0.25e-3])
