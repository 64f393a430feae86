"""Agent rollouts on the tiny random model: user functions written against the real `openai`
clients talk to the policy's endpoint; the training sequences are the recorded token ids
(never sampled text tokenized again), split where a call does not extend the last one;
faults are counted and never stop the rollout; the same step gives the same batch."""

import copy

import agent_fns
import numpy as np
import pytest
import torch

from hybrid_engine.config import ConfigError, load_config
from hybrid_engine.engine import Engine
from hybrid_engine.rollout.agent.chat import BadRequest, ChatRequest, parse_completion
from hybrid_engine.rollout.agent.episodes import Episode
from hybrid_engine.rollout.agent.examples import run_tool
from hybrid_engine.rollout.multiturn import encode, render

pytestmark = pytest.mark.fast
TIMEOUT = "rollout.agent.timeout_s=3"


def engine_for(fn: str, *extra: str) -> Engine:
    return Engine(
        load_config("configs/grpo_tiny.yaml", [f"rollout.agent.function=agent_fns:{fn}", *extra])
    )


class Log:
    """An episode log in memory (the rollout task's commits to storage, without storage)."""

    def __init__(self, keep: dict | None = None) -> None:
        self.saved: dict[int, dict] = dict(keep or {})

    def load(self, i: int) -> dict | None:
        return self.saved.get(i)

    def save(self, i: int, doc: dict) -> None:
        self.saved[i] = copy.deepcopy(doc)


def rows_of(batch, episode: int) -> list[int]:
    return [j for j, e in enumerate(batch["episode"]) if e == episode]


def trained(batch, j: int) -> list[int]:
    return batch["response_ids"][j][batch["response_mask"][j].bool()].tolist()


def prompt(batch, j: int) -> list[int]:
    return batch["prompt_ids"][j][batch["prompt_mask"][j].bool()].tolist()


def test_async_agent_two_calls_make_one_token_exact_sequence():
    engine, log = engine_for("answer_then_revise"), Log()
    batch = engine.rollout(1, episode_log=log)
    m = batch.meta["metrics"]
    assert m["agent/episodes"] == 16 and m["agent/sequences"] == 16 and m["agent/splits"] == 0
    assert m["agent/calls/mean"] == 2 and m["agent/fault_rate"] == 0
    reused = looked_up = 0  # the second call prefills only what follows the first's tokens
    for i, doc in log.saved.items():
        ep = Episode.from_json(doc)
        first, second = ep.calls
        assert second.extends == [0, 0]
        sampled = first.choices[0].ids
        assert (
            second.prompt_ids[: len(first.prompt_ids) + len(sampled)] == first.prompt_ids + sampled
        )
        (j,) = rows_of(batch, i)
        assert prompt(batch, j) == first.prompt_ids
        assert trained(batch, j) == sampled + second.choices[0].ids
        width = len(second.prompt_ids) + len(second.choices[0].ids) - len(first.prompt_ids)
        seen = batch["attention_mask"][j, -batch["response_mask"].shape[1] :]
        assert int(seen.sum()) == width  # the context between the calls is there, untrained
        reused += len(first.prompt_ids) + len(sampled) - 1  # all but the last fed token
        looked_up += len(first.prompt_ids) + len(second.prompt_ids)
    assert reused / looked_up <= m["agent/prefix_cache_hit_rate"] < 1
    # the reward stage scores each episode's final answer (the agent returned None)
    scored = engine.reward(batch)
    assert scored["scores"].shape == (16,)


def test_sync_agent_kwargs_rewards_and_info():
    engine = engine_for("answer_sync", "rollout.agent.kwargs={scale: 2.0}")
    batch = engine.reward(engine.rollout(1))
    m = batch.meta["metrics"]
    assert all(len(trained(batch, j)) <= 6 for j in range(len(batch)))  # max_tokens=6
    texts = batch["final_response"]
    assert batch["scores"].tolist() == pytest.approx([2.0 * len(t) / 100 for t in texts])
    assert batch["acc"].tolist() == [float(len(t) > 10) for t in texts]  # info's success
    assert m["agent/info/chars/mean"] == pytest.approx(sum(map(len, texts)) / len(texts))


def test_request_options_reach_the_backend():
    batch = engine_for("probe").rollout(1)
    m = batch.meta["metrics"]
    assert m["agent/info/models/mean"] == 1 and m["agent/info/choices/mean"] == 3
    assert m["agent/info/longest/mean"] <= 5
    assert m["agent/info/logprob_tokens/mean"] == m["agent/info/completion_tokens/mean"]
    # n=3 choices, the agent went on with none: three sequences per episode
    assert m["agent/sequences"] == 48 and m["agent/splits"] == 0


def test_rewritten_history_splits_the_episode():
    engine, log = engine_for("rewrite_history"), Log()
    batch = engine.reward(engine.rollout(1, episode_log=log))
    assert batch.meta["metrics"]["agent/splits"] == 16 and len(batch) == 32
    for i, doc in log.saved.items():
        calls = Episode.from_json(doc).calls
        assert calls[1].extends is None
        a, b = rows_of(batch, i)
        assert batch["uid"][a] == batch["uid"][b]
        assert prompt(batch, b) == calls[1].prompt_ids
        assert trained(batch, a) == calls[0].choices[0].ids
        assert trained(batch, b) == calls[1].choices[0].ids
    assert batch["scores"].tolist() == [0.5] * 32


# Earlier assistant turns lose their <think> part (as DeepSeek-R1's and Qwen3's templates do):
# the generation prompt opens "<think>\n", history renders only what follows "</think>".
THINK_TEMPLATE = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' + m.content.split('</think>')[-1] + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif -%}"
)


def test_reasoning_template_that_drops_think_blocks_trains_the_sampled_ids():
    engine, log = engine_for("answer_then_revise"), Log()
    tok = engine.tokenizer = copy.deepcopy(engine.tokenizer)
    tok.chat_template = THINK_TEMPLATE
    batch = engine.rollout(1, episode_log=log)
    assert batch.meta["metrics"]["agent/splits"] == 16
    for i, doc in log.saved.items():
        first, second = Episode.from_json(doc).calls
        assert second.extends is None
        a, b = rows_of(batch, i)
        assert trained(batch, a) == first.choices[0].ids  # exactly what was sampled
        assert trained(batch, b) == second.choices[0].ids
        assert prompt(batch, a) == first.prompt_ids and prompt(batch, b) == second.prompt_ids
        # the premise: the template's own rendering of the conversation drops the "<think>\n"
        # the first answer was sampled after, so its tokens are not the sampled ones
        whole = [*second.messages, second.choices[0].message]
        rerendered = encode(tok, render(tok, whole, None, False))
        sampled = first.prompt_ids + first.choices[0].ids
        assert rerendered[: len(sampled)] != sampled


@pytest.mark.parametrize(
    "fn, reason",
    [
        ("raises", "raised"),
        ("hangs", "timeout"),
        ("hangs_sync", "timeout"),
        ("junk", "bad_return"),
        ("unknown_tool", "unknown_tool"),
        ("malformed", "malformed_message"),
        ("no_call", "no_calls"),
    ],
)
def test_each_fault_is_counted_and_scored_zero(fn, reason, caplog):
    engine = engine_for(fn, TIMEOUT)
    batch = engine.reward(engine.rollout(1))
    m = batch.meta["metrics"]
    assert m[f"agent/faults/{reason}"] == 16 and m["agent/fault_rate"] == 1
    assert batch["scores"].tolist() == [0.0] * len(batch)
    assert batch["agent_fault"] == [reason] * len(batch)
    named = [r for r in caplog.records if r.name == "hybridrl.agent"]
    assert len(named) == 16 and all(reason in r.getMessage() for r in named)
    engine.update(engine.advantage(batch))  # the step goes on


def test_dropped_faults_leave_the_batch_and_the_step_trains():
    engine = engine_for("picky", "rollout.agent.on_fault=drop")
    batch = engine.reward(engine.rollout(1))
    m = batch.meta["metrics"]
    faults = m.get("agent/faults/raised", 0)
    assert 0 < faults < 16 and len(batch) == 16 - faults == 16 - m["agent/dropped"]
    assert all(len(t) % 2 == 0 for t in batch["final_response"])
    result = engine.update(engine.advantage(batch))
    assert result.meta["metrics"]["actor/pg_loss"] == result.meta["metrics"]["actor/pg_loss"]


def test_same_step_same_batch_and_resumed_episodes_are_reused():
    first, log = engine_for("answer_then_revise"), Log()
    a = first.rollout(1, episode_log=log)
    b = engine_for("answer_then_revise").rollout(1)
    for k in ("input_ids", "response_mask", "attention_mask"):
        assert torch.equal(a[k], b[k]), k
    # a rollout killed after 5 episodes: those come back as they were, the rest run again
    kept = {i: log.saved[i] for i in range(5)}
    for doc in kept.values():  # mark them: a reused episode keeps what was recorded
        doc["calls"][0]["choices"][0]["log_probs"][0] = -123.0
    resumed = engine_for("answer_then_revise", "algorithm.rollout_correction.level=token")
    c = resumed.rollout(1, episode_log=Log(kept))
    assert c.meta["metrics"]["agent/resumed"] == 5
    lps = c["rollout_log_probs"]
    assert all(float(lps[rows_of(c, i)[0], 0]) == -123.0 for i in range(5))
    assert all(float(lps[rows_of(c, i)[0], 0]) != -123.0 for i in range(5, 16))


def test_validation_scores_each_episode_once():
    engine = engine_for("rewrite_history", "data.val_size=4")
    out = engine.validate(2)
    assert out["val/score/mean"] == 0.5 and len(out["_samples"]) == 2


def test_tool_calls_are_parsed_by_the_template_convention(tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    req = ChatRequest.parse({"messages": [{"role": "user", "content": "x"}], "tools": tools})
    text = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    msg = parse_completion(tokenizer, text, [], req, "c")
    assert msg["content"] == "Let me add."
    assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1}}
    for other in (
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        "<tool_call>{</tool_call>",
    ):
        assert parse_completion(tokenizer, other, [], req, "c") == {
            "role": "assistant",
            "content": other,
        }
    no_tools = ChatRequest.parse({"messages": [{"role": "user", "content": "x"}]})
    assert "tool_calls" not in parse_completion(tokenizer, text, [], no_tools, "c")


def test_bad_requests_name_the_field():
    with pytest.raises(BadRequest, match="messages: List should have at least 1"):
        ChatRequest.parse({"messages": []})
    with pytest.raises(BadRequest, match="^n: "):
        ChatRequest.parse({"messages": [{"role": "user", "content": "x"}], "n": 0})
    with pytest.raises(BadRequest, match="stream"):
        ChatRequest.parse({"messages": [{"role": "user", "content": "x"}], "stream": True})


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="rollout.agent.function"):
        load_config("configs/grpo_tiny.yaml", ["rollout.agent.function=agent_fns:nope"])
    with pytest.raises(ConfigError, match="rollout.multi_turn.enabled"):
        load_config("configs/multiturn_tiny.yaml", ["rollout.agent.function=agent_fns:answer_sync"])


def prompt_index(batch) -> list[int]:
    return [int(u.split("-")[1]) for u in batch["uid"]]


def test_numpy_torch_and_bool_rewards_are_trained_as_the_same_float():
    kinds = "{kinds: [float32, int64, bool_, tensor], wrap: false}"
    engine = engine_for("typed_reward", f"rollout.agent.kwargs={kinds}")
    batch = engine.reward(engine.rollout(1))
    assert batch.meta["metrics"]["agent/fault_rate"] == 0
    expected = [torch.tensor(x).item() for x in (float(np.float32(0.1)), 2.0, 1.0, 0.75)]
    assert batch["scores"].tolist() == [expected[k] for k in prompt_index(batch)]


def test_non_finite_or_non_number_rewards_are_bad_returns_named(caplog):
    """In a dict too; a bool is 0/1."""
    kinds = "{kinds: [bool, float32_nan, inf, tensor_2], wrap: true}"
    engine = engine_for("typed_reward", f"rollout.agent.kwargs={kinds}")
    batch = engine.reward(engine.rollout(1))
    assert batch.meta["metrics"]["agent/faults/bad_return"] == 12
    assert batch["agent_fault"] == ["bad_return" if k else "" for k in prompt_index(batch)]
    assert batch["scores"].tolist() == [0.0] * 16  # False: 0.0, trained; the rest: faults
    named = [r.getMessage() for r in caplog.records if r.name == "hybridrl.agent"]
    assert len(named) == 12 and all("episode" in m and "bad_return" in m for m in named)


def test_none_scores_the_episodes_final_answer_on_every_row():
    engine, log = (
        engine_for("split_then_none", "reward.function=reward_fns:length_score"),
        Log(),
    )
    batch = engine.reward(engine.rollout(1, episode_log=log))
    assert batch.meta["metrics"]["agent/splits"] == 16 and len(batch) == 32
    for i, doc in log.saved.items():
        final = Episode.from_json(doc).calls[-1].choices[0].message["content"]
        for j in rows_of(batch, i):  # the first chain's row too
            assert batch["final_response"][j] == final
            assert float(batch["scores"][j]) == pytest.approx(len(final) / 100)


def test_validation_scores_the_episodes_final_answer():
    engine = engine_for(
        "split_then_none",
        "reward.function=reward_fns:length_score",
        "data.val_size=8",
        "rollout.val.temperature=1.0",
    )
    agent_fns.FINALS.clear()
    out = engine.validate(8)
    n = len(engine.data.val)
    finals = [agent_fns.FINALS[f"val-{i}"] for i in range(n)]
    assert out["val/score/mean"] == pytest.approx(sum(len(f) / 100 for f in finals) / n)
    samples = out["_samples"]
    assert [s["score"] for s in samples] == pytest.approx([len(f) / 100 for f in finals])
    assert all(
        s["response"].rstrip().endswith(f.strip()) for s, f in zip(samples, finals, strict=True)
    )


BOOM_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.content == 'BOOM' %}{{ raise_exception('this template refuses BOOM') }}{% endif -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)


def test_a_chat_template_that_raises_is_a_400_and_a_fault():
    engine = engine_for("template_boom")
    engine.tokenizer = copy.deepcopy(engine.tokenizer)
    engine.tokenizer.chat_template = BOOM_TEMPLATE
    agent_fns.STATUSES.clear()
    batch = engine.rollout(1)
    m = batch.meta["metrics"]
    assert agent_fns.STATUSES == [400] * 16
    assert (
        m["agent/faults/template_error"] == 16 and batch["agent_fault"] == ["template_error"] * 16
    )


# transformers' response_template that reads the whole completion as one JSON tool call: the
# random model's text never parses
JSON_ONLY = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\A",
            "close_pattern": r"\Z",
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        }
    },
}


def test_a_completion_the_response_template_cannot_parse_is_a_fault():
    engine = engine_for("offers_tool")
    engine.tokenizer = copy.deepcopy(engine.tokenizer)
    engine.tokenizer.response_template = JSON_ONLY
    batch = engine.rollout(1)
    m = batch.meta["metrics"]
    assert m["agent/faults/malformed_completion"] == 16 and m["agent/fault_rate"] == 1


@pytest.mark.parametrize("fn", ["exits", "exits_sync"])
def test_system_exit_in_an_agent_faults_its_episode_only(fn):
    engine = engine_for(fn, TIMEOUT)
    batch = engine.reward(engine.rollout(1))
    m = batch.meta["metrics"]
    assert m["agent/faults/raised"] == 4 and m["agent/fault_rate"] == 4 / 16
    first = [u.endswith("-0") for u in batch["uid"]]
    assert batch["agent_fault"] == ["raised" if f else "" for f in first]
    assert batch["scores"].tolist() == [0.0 if f else 1.0 for f in first]


def test_the_shipped_calculator_is_bounded():
    assert run_tool('{"expression": "3 * (2 + 5)"}') == "21"
    assert run_tool('{"expression": "2 ** 5000"}').startswith("error: ValueError")
    assert run_tool('{"expression": "9 ** 9 ** 9"}').startswith("error: ValueError")
    assert run_tool('{"expression": "(10 ** 1000) * (10 ** 1000)"}').startswith("error")


def test_an_agents_own_top_p_or_top_k_is_refused():
    agent_fns.SAMPLING_ERRORS.clear()
    batch = engine_for("own_top_p").rollout(1)
    assert agent_fns.SAMPLING_ERRORS == ["unsupported_sampling"] * 32
    assert batch.meta["metrics"]["agent/faults/unsupported_sampling"] == 16


def test_per_token_temperatures_give_each_tokens_log_probs_and_gradients(tokenizer):
    """A (rows, response) temperature tensor: each token's values and gradients are those of
    a scalar temperature run at its own temperature, padded and packed."""
    from test_packing import grpo_like_batch

    from hybrid_engine.config import ModelConfig
    from hybrid_engine.models.loading import load_policy
    from hybrid_engine.models.logprobs import packed_response_log_probs, response_log_probs

    model = load_policy(ModelConfig(path="tiny"), tokenizer, seed=0).train()
    ids, mask, n = grpo_like_batch(tokenizer.pad_token_id, tokenizer.eos_token_id)
    hot = torch.zeros(len(ids), n, dtype=torch.bool)
    hot[::2, 1::2] = True  # a checkerboard of tokens at 0.5, the others at 1.3
    temps = torch.where(hot, 0.5, 1.3)
    head = model.get_output_embeddings().weight
    for fn in (response_log_probs, packed_response_log_probs):
        model.zero_grad()
        mixed, ent = fn(model, ids, mask, n, temps, with_entropy=True)
        (mixed.sum() + ent.sum()).backward()
        grad_mixed = head.grad.clone()
        expected, grad_expected = torch.zeros_like(mixed), torch.zeros_like(head)
        for t, where in ((0.5, hot), (1.3, ~hot)):
            model.zero_grad()
            lp, e = fn(model, ids, mask, n, t, with_entropy=True)
            (lp[where].sum() + e[where].sum()).backward()
            expected[where] = lp.detach()[where]
            grad_expected += head.grad
        assert torch.allclose(mixed.detach(), expected, atol=1e-6)
        assert torch.allclose(grad_mixed, grad_expected, atol=1e-5)


def test_a_prompt_past_max_context_tokens_is_refused(caplog):
    engine = engine_for("answer_then_revise", "rollout.agent.max_context_tokens=10")
    batch = engine.rollout(1)
    assert batch.meta["metrics"]["agent/faults/context_length"] == 16
    named = [r.getMessage() for r in caplog.records if r.name == "hybridrl.agent"]
    assert len(named) == 16 and all("max_context_tokens=10" in m for m in named)


def test_max_tokens_above_the_cap_is_cut_to_it():
    engine = engine_for("asks_too_much")  # rollout.max_new_tokens=8
    batch = engine.rollout(1)
    m = batch.meta["metrics"]
    assert m["agent/fault_rate"] == 0 and m["agent/info/tokens/mean"] == m["agent/info/used/mean"]
    assert all(len(trained(batch, j)) <= 8 for j in range(len(batch)))
    assert 0 < m["agent/info/tokens/mean"] <= 8


def test_unknown_and_ended_episode_keys_are_refused(tokenizer):
    import httpx

    from hybrid_engine.rollout.agent.endpoint import Hub, Server, make_app

    hub = Hub([Episode(), Episode()], lambda *a: ([1, 2], None), 64, 0)
    body = {"messages": [{"role": "user", "content": "x"}]}
    with Server(make_app(hub)) as server:
        unknown = httpx.post(f"{server.url('0123abcd')}/chat/completions", json=body)
        hub.finish(0, 1.0, {}, "", "")
        ended = httpx.post(f"{server.url(hub.key_of[0])}/chat/completions", json=body)
        no_key = httpx.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_episode"
    assert ended.status_code == 409 and ended.json()["error"]["code"] == "episode_ended"
    assert no_key.status_code == 400 and no_key.json()["error"]["code"] == "unknown_episode"
    assert hub.status == ["done", "queued"] and not hub.pending
