"""Supervised warm-start on the tiny random model: demonstrations become the tokens an agent
episode records (the replies trained, the rest context); fine-tuning on them makes a policy
that never called the calculator call it through the agent endpoint."""

import json

import pytest
import torch
from safetensors.torch import load_file

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.models.loading import load_tokenizer
from hybrid_engine.rollout.agent.examples import calculator_demonstration
from hybrid_engine.rollout.multiturn import render
from hybrid_engine.warmstart import demonstration_ids, demonstrations, warm_start

pytestmark = pytest.mark.fast
DEMOS = "hybrid_engine.rollout.agent.examples:calculator_demonstration"
AGENT = [
    "rollout.agent.function=hybrid_engine.rollout.agent.examples:calculator_agent",
    "rollout.max_new_tokens=32",
]


def tiny(*extra: str):
    return load_config("configs/grpo_tiny.yaml", [*AGENT, *extra])


def test_demonstration_tokens_are_the_template_with_only_the_replies_trained():
    cfg = tiny()
    tokenizer = load_tokenizer(cfg.model)
    assert len(demonstrations(cfg, DEMOS, 2)) == 2
    row = {
        "prompt": [{"role": "user", "content": "Calculate 2 + 3."}],
        "extra_info": {"rg_entry": {"metadata": {"expression": "2 + 3"}}},
    }
    messages = calculator_demonstration(row)
    ids, mask = demonstration_ids(tokenizer, messages)
    assert tokenizer.decode(ids) + "\n" == render(tokenizer, messages, None, False)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
    assert (
        tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        == f"{call}<|im_end|>5<|im_end|>"
    )
    assert calculator_demonstration({"prompt": [], "extra_info": {}}) is None


def test_a_template_that_rewrites_history_and_bad_demos_are_refused_by_name(tmp_path):
    cfg = tiny()
    tokenizer = load_tokenizer(cfg.model)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
        "<|im_start|>assistant\n(earlier)<|im_end|>\n{% else %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    with pytest.raises(ValueError, match="message 3: the chat template renders"):
        demonstration_ids(tokenizer, messages)
    with pytest.raises(ValueError, match="no assistant message"):
        demonstration_ids(tokenizer, messages[:1])
    with pytest.raises(ValueError, match="--demos='nowhere:f' cannot be loaded"):
        demonstrations(cfg, "nowhere:f", 4)
    with pytest.raises(ValueError, match="no_prompt on training row 0: message 0: needs a role"):
        demonstrations(cfg, "test_warmstart:no_prompt", 4)
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="taken"):
        warm_start(cfg, DEMOS, tmp_path / "taken")


def no_prompt(row: dict) -> list[dict]:
    return [{"content": "no role"}]


def test_warm_start_makes_the_tiny_policy_call_the_tool_and_is_deterministic(tmp_path):
    cfg = tiny("rollout.temperature=0.7")
    before = Engine(cfg).rollout(1).meta["metrics"]
    assert before["agent/tool_calls/mean"] == 0  # a random model writes no tool call

    got = warm_start(cfg, DEMOS, tmp_path / "a", examples=64, epochs=12, lr=3e-3)
    assert got["losses"][-1] < got["losses"][0] / 10
    assert json.loads((tmp_path / "a" / "warmstart.json").read_text())["examples"] == 64
    warm_start(cfg, DEMOS, tmp_path / "b", examples=64, epochs=1, lr=3e-3)
    again = warm_start(cfg, DEMOS, tmp_path / "c", examples=64, epochs=1, lr=3e-3)
    a, b = (
        load_file(tmp_path / "b" / "model.safetensors"),
        load_file(tmp_path / "c" / "model.safetensors"),
    )
    assert again["losses"] == got["losses"][: len(again["losses"])]
    assert all(torch.equal(a[k], b[k]) for k in a)

    after = Engine(tiny("rollout.temperature=0.7", f"model.path={tmp_path / 'a'}"))
    m = after.rollout(1).meta["metrics"]
    assert m["agent/tool_calls/mean"] >= 0.5 and m["agent/fault_rate"] == 0
    assert m["agent/calls/mean"] > 1  # the tool's results went back to the policy
