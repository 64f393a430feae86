"""verifiers environments (the real package, the [verifiers] extra) as data and agents: the
environment's dataset and eval split become the rows, its own rollout talks to the policy's
endpoint, its rubric scores (environments in tests/vf_envs.py)."""

import pytest

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine

pytestmark = pytest.mark.fast


def engine_for(env: str) -> Engine:
    return Engine(
        load_config("configs/verifiers_tiny.yaml", [f"data.train_source=verifiers:vf_envs:{env}"])
    )


def trained(batch, j):
    return batch["response_ids"][j][batch["response_mask"][j].bool()].tolist()


def test_single_turn_env_supplies_rows_and_its_rubric_scores():
    engine = engine_for("single_turn")
    train = {r["prompt"][-1]["content"] for r in engine.data.train}
    val = {r["prompt"][-1]["content"] for r in engine.data.val}
    assert len(train) == 24 and len(engine.data.val) == 4 and not train & val  # eval split
    assert engine.data.train[0]["prompt"][0] == {
        "role": "system",
        "content": "Answer with a number.",
    }
    batch = engine.reward(engine.rollout(1))
    m = batch.meta["metrics"]
    assert m["agent/calls/mean"] == 1 and m["agent/fault_rate"] == 0
    expected = [min(len(t) / 40, 1.0) for t in batch["final_response"]]  # the rubric's reward
    assert batch["scores"].tolist() == pytest.approx(expected)
    assert "agent/info/mentions_answer/mean" in m  # a rubric metric (weight 0)
    engine.update(engine.advantage(batch))


def test_multi_turn_env_runs_its_own_turns_as_one_sequence():
    engine = engine_for("multi_turn")
    batch = engine.reward(engine.rollout(1))
    m = batch.meta["metrics"]
    assert m["agent/calls/mean"] == 2 and m["agent/splits"] == 0 and len(batch) == 16
    assert m["agent/info/turns/mean"] == 2
    for j, messages in enumerate(batch["messages"]):
        assert [x["role"] for x in messages][-3:] == ["assistant", "user", "assistant"]
        assert messages[-2]["content"] == "Are you sure? Answer again."
        assert len(trained(batch, j)) == int(batch["response_mask"][j].sum())
    val = engine.validate(1)
    assert val["val/turns/mean"] == 2 and len(val["_samples"]) == 1


def test_a_bad_environment_is_named():
    with pytest.raises(ValueError, match="verifiers:vf_envs:nope"):
        engine_for("nope")


def test_a_verifiers_val_source_takes_the_eval_split():
    from hybrid_engine.data import PromptData

    source = "data.val_source=verifiers:vf_envs:single_turn"
    data = PromptData(load_config("configs/verifiers_tiny.yaml", [source]).data)
    train = {r["prompt"][-1]["content"] for r in data.train}
    val = {r["prompt"][-1]["content"] for r in data.val}
    assert data.val_dropped == 0 and len(val) == 4 and not train & val  # QUESTIONS[24:]
