"""A NaN/Inf loss or gradient never reaches the weights: refused (the run fails naming the
step, the micro-batch and the tensor) or, with skip_nonfinite_steps, skipped and counted."""

import pytest
import torch

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.roles.updates import NonFiniteUpdate

NAN = [
    "algorithm.plugins=[plugin_nan]",
    "actor.policy_loss.mode=plugin_nan",
    "reward.function=reward_fns:length_score",
]


def weights(engine):
    return {k: v.clone() for k, v in engine.actor.policy.state_dict().items()}


@pytest.mark.parametrize("mini", [8, 4])  # one optimizer step per update, or two
def test_a_nan_update_is_refused_and_names_where(mini):
    engine = Engine(
        load_config("configs/grpo_tiny.yaml", [*NAN, f"actor.ppo_mini_batch_size={mini}"])
    )
    before = weights(engine)
    with pytest.raises(
        NonFiniteUpdate,
        match=r"step 1: actor update refused: gradient norm nan "
        r"in mini-batch 0 \(epoch 0\); micro-batch 0 has loss nan; first "
        r"non-finite tensor: the gradient of model\.",
    ) as e:
        engine.step(1)
    assert e.value.stepped == 0 and "\n" not in str(e.value)
    after = weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing reached the weights
    assert engine.actor.weights_version == -1  # a resume reloads the last checkpoint


def test_skip_nonfinite_steps_skips_and_counts():
    engine = Engine(
        load_config(
            "configs/grpo_tiny.yaml",
            [*NAN, "actor.skip_nonfinite_steps=true", "actor.ppo_mini_batch_size=4"],
        )
    )
    before = weights(engine)
    metrics = engine.step(1)
    assert metrics["actor/nonfinite_skipped"] == 4.0  # 16 samples / 4 per mini-batch
    assert engine.actor.weights_version == 1
    after = weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
