"""Multi-turn rollouts on the tiny random model: masks, cut-offs, batching, determinism,
rewards, and what the losses, the packed forward and the estimators make of interior zeros."""

import time

import pytest
import torch
from hand import T, close

from hybrid_engine.algorithms import POLICY_LOSSES
from hybrid_engine.algorithms.losses import policy_loss
from hybrid_engine.config import ConfigError, load_config
from hybrid_engine.engine import Engine
from hybrid_engine.models.logprobs import packed_response_log_probs, response_log_probs
from hybrid_engine.rewards import token_level_scores
from hybrid_engine.rollout.base import SamplingParams
from hybrid_engine.rollout.envs import make_environment
from hybrid_engine.rollout.envs.tool_runner import ToolRunner
from hybrid_engine.rollout.multiturn import (
    multi_turn_metrics,
    multi_turn_rollout,
    multi_turn_scores,
)

PRESET = "configs/multiturn_tiny.yaml"


@pytest.fixture(scope="module")
def engine():
    return Engine(load_config(PRESET))


def spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of a 0/1 list."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def rollout(engine, rows, greedy=False, **kw):
    """A multi-turn rollout of prompt rows with a recording generate: (batch, per-turn
    generated token lists per row)."""
    mt = engine.cfg.rollout.multi_turn
    seen = []

    def generate(batch, sampling):
        out = engine.actor.generate(batch, sampling)
        seen.append(
            [
                r[m.bool()].tolist()
                for r, m in zip(out["response_ids"], out["response_mask"], strict=True)
            ]
        )
        return out

    prompts = rows.take(list(range(len(rows))))
    envs = [
        make_environment(kw.pop("environment", mt.environment), kw.pop("env_kwargs", {}))
        for _ in range(len(prompts))
    ]
    sampling = SamplingParams(8, 0.0 if greedy else 1.0, seed=7, log_probs=True)
    args = {"max_turns": mt.max_turns, "max_total_tokens": mt.max_total_tokens} | kw
    batch = multi_turn_rollout(
        generate,
        engine.tokenizer,
        prompts,
        envs,
        sampling,
        args["max_turns"],
        args["max_total_tokens"],
        256,
    )
    return batch, seen


@pytest.fixture(scope="module")
def prompts(engine):
    from hybrid_engine.data import prompt_batch

    b = prompt_batch(engine.data.step_rows(1), engine.tokenizer, 256)
    b["uid"] = [str(i) for i in range(len(b))]
    return b


def test_policy_tokens_and_only_they_have_mask_one(engine, prompts):
    batch, seen = rollout(engine, prompts)
    eos = engine.tokenizer.eos_token_id
    for i in range(len(batch)):
        mask = batch["response_mask"][i].tolist()
        ids = batch["response_ids"][i].tolist()
        runs = [s for s in spans(mask) if s[0] == 1]
        assert len(runs) == batch["turns"][i] == 3  # a random model never answers right
        # turn k's mask-1 run is exactly what the policy sampled at turn k
        for k, (_, a, b) in enumerate(runs):
            assert ids[a:b] == seen[k][i]
        zeros = [s for s in spans(mask[: runs[-1][2]]) if s[0] == 0]
        assert len(zeros) == 2  # interior zeros: the two observations
        for _, a, b in zeros:
            text = engine.tokenizer.decode(ids[a:b])
            assert "<|im_start|>user\n" in text and text.endswith("<|im_start|>assistant\n")
            assert ids[a] == eos or ids[a - 1] == eos  # the turn is closed
        assert batch["attention_mask"][i, -len(mask) :].sum() == runs[-1][2]
        assert batch["turn_ends"][i] == [b - 1 for _, _, b in runs]
        # rollout log-probs only on policy tokens
        lp = batch["rollout_log_probs"][i]
        assert (lp[torch.tensor(mask) == 0] == 0).all() and (lp[torch.tensor(mask) == 1] < 0).all()


def test_batched_turns_equal_one_trajectory_at_a_time_under_greedy(engine, prompts):
    together, _ = rollout(engine, prompts.take([0, 1, 2, 3]), greedy=True)
    for i in range(4):
        alone, _ = rollout(engine, prompts.take([i]), greedy=True)
        n = alone["response_ids"].shape[1]
        assert together["response_ids"][i, :n].tolist() == alone["response_ids"][0].tolist()
        assert together["response_mask"][i, :n].tolist() == alone["response_mask"][0].tolist()
        assert together["messages"][i] == alone["messages"][0]


def test_prefix_cache_leaves_trajectories_and_log_probs_as_fresh_prefills(engine, prompts):
    """Turns 2 and 3 prefill only their new tokens; sampled under one seed, the trajectories
    are those of prefilling every turn's whole context, log-probs within 1e-5."""
    cached, _ = rollout(engine, prompts)
    kept, engine.actor.rollout.prefixes = engine.actor.rollout.prefixes, None
    try:
        fresh, _ = rollout(engine, prompts)
    finally:
        engine.actor.rollout.prefixes = kept
    assert torch.equal(cached["response_ids"], fresh["response_ids"])
    mask = cached["response_mask"].bool()
    lp_cached, lp_fresh = cached["rollout_log_probs"], fresh["rollout_log_probs"]
    assert (lp_cached - lp_fresh)[mask].abs().max() < 1e-5
    rate = multi_turn_metrics(cached)["multi_turn/prefix_cache_hit_rate"]
    assert 0.5 < rate < 1, rate  # turn 1 misses; later turns hit all but their new tokens
    assert "multi_turn/prefix_cache_hit_rate" not in multi_turn_metrics(fresh)
    assert len(kept) == 0  # the last turn kept nothing


def test_same_seed_same_trajectories(engine, prompts):
    a, _ = rollout(engine, prompts)
    b, _ = rollout(engine, prompts)
    assert torch.equal(a["response_ids"], b["response_ids"]) and a["messages"] == b["messages"]


def test_max_turns_and_max_total_tokens_cut_trajectories(engine, prompts):
    one, _ = rollout(engine, prompts, max_turns=1)
    assert one["turns"] == [1] * len(one) and set(one["stop"]) == {"max_turns"}
    assert (
        one["response_mask"].sum(-1)
        == one["attention_mask"][:, -one["response_ids"].shape[1] :].sum(-1)
    ).all()
    short, _ = rollout(engine, prompts, max_total_tokens=30)
    assert short["response_ids"].shape[1] <= 30 and set(short["stop"]) == {"max_total_tokens"}
    assert all(t < 3 for t in short["turns"])
    tight, _ = rollout(engine, prompts, max_total_tokens=5)  # the budget cuts the first turn
    assert tight["response_mask"].sum(-1).tolist() == [5] * len(tight)


def test_losses_ignore_observation_tokens(engine, prompts):
    batch, _ = rollout(engine, prompts)
    mask = batch["response_mask"]
    obs = (mask == 0) & (batch["attention_mask"][:, -mask.shape[1] :] == 1)
    assert obs.any()
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(mask.shape, generator=g)
    adv = torch.randn(mask.shape, generator=g)
    for mode in POLICY_LOSSES:
        results = []
        for shift in (0.0, 5.0):
            logp = old + 0.1 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
            logp = torch.where(obs, logp + shift, logp).requires_grad_(True)
            loss = policy_loss(old, logp, adv, mask, loss_mode=mode)[0]
            loss.backward()
            results.append((loss.detach(), logp.grad[~obs]))
        torch.testing.assert_close(results[0][0], results[1][0], msg=mode)
        torch.testing.assert_close(results[0][1], results[1][1], msg=mode)


def test_packed_forward_respects_interior_zeros(engine, prompts):
    batch, _ = rollout(engine, prompts.take([0, 1]))
    batch = batch.repeat_interleave(2)  # groups of two rows with the same prompt
    model, n = engine.actor.policy, batch["response_ids"].shape[1]
    padded, ent = response_log_probs(
        model, batch["input_ids"], batch["attention_mask"], n, 1.0, True
    )
    packed, ent_p = packed_response_log_probs(
        model, batch["input_ids"], batch["attention_mask"], n, 1.0, True
    )
    seen = batch["attention_mask"][:, -n:].bool()
    torch.testing.assert_close(packed[seen], padded[seen], atol=2e-5, rtol=0)
    torch.testing.assert_close(ent_p[seen], ent[seen], atol=2e-5, rtol=0)


@pytest.mark.fast
def test_rewards_land_on_the_last_policy_token():
    mask = T([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]], torch.long)
    close(token_level_scores([2.0, 3.0], mask), [[0, 0, 0, 0, 2, 0], [3, 0, 0, 0, 0, 0]])


@pytest.mark.fast
def test_env_rewards_scorer_fallback_and_per_turn_placement():
    from hybrid_engine.batch import Batch

    mask = T([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0]], torch.long)
    batch = Batch(
        {"response_mask": mask},
        {
            "env_reward": [2.0, None],
            "turn_ends": [[1, 3], [0]],
            "turn_rewards": [[0.5, 2.0], [None]],
            "success": [True, None],
        },
    )
    scores, acc, tls = multi_turn_scores(batch, {1: 0.25}, per_turn=False)
    close(scores, [2.0, 0.25])
    close(acc, [1.0, 0.0])
    close(tls, [[0, 0, 0, 2.0, 0], [0.25, 0, 0, 0, 0]])
    scores, _, tls = multi_turn_scores(batch, {1: 0.25}, per_turn=True)
    close(scores, [2.5, 0.25])
    close(tls, [[0, 0.5, 0, 2.0, 0], [0.25, 0, 0, 0, 0]])


def test_engine_steps_learn_from_multi_turn_trajectories():
    cfg = load_config(
        PRESET,
        [
            "rollout.multi_turn.environment=env_fns:TwoTurns",
            "reward.function=reward_fns:length_score",
        ],
    )
    engine = Engine(cfg)
    before = {k: v.clone() for k, v in engine.actor.policy.state_dict().items()}
    metrics = engine.step(1)
    assert metrics["multi_turn/turns/mean"] == 2.0 and metrics["multi_turn/stop/done"] == 1.0
    assert metrics["multi_turn/observation_tokens/mean"] > 0
    after = engine.actor.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    val = engine.validate(1)
    assert val["val/turns/mean"] == 2.0 and "[assistant]" in val["_samples"][0]["response"]


@pytest.mark.fast
def test_feedback_env_says_which_way_and_discounts():
    env = make_environment("feedback", {"turn_discount": 0.5})
    row = {
        "prompt": [{"role": "user", "content": "2+2?"}],
        "data_source": "x",
        "ground_truth": "4",
        "extra_info": {},
    }
    assert env.reset(row, 0) == row["prompt"]
    obs, reward, done, info = env.step("It is 5.")
    assert "too high" in obs[0]["content"] and reward == 0.0 and not done
    assert "too low" in env.step("3")[0][0]["content"]
    assert env.step("So 4.") == (None, 0.25, True, {"success": True})


@pytest.mark.fast
def test_tool_that_raises_hangs_or_floods_is_an_observation():
    env = make_environment(
        "tools",
        {
            "tools": ["env_fns:add", "env_fns:boom", "env_fns:hang", "env_fns:huge"],
            "timeout_s": 1.0,
        },
    )
    env.protocol = "text"
    row = {
        "prompt": [{"role": "user", "content": "q"}],
        "data_source": "x",
        "ground_truth": "5",
        "extra_info": {},
    }
    system = env.reset(row, 0)[0]
    assert system["role"] == "system" and '"name": "add"' in system["content"]

    def call(name, args='{"x": 1}'):
        return env.step(f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>')

    assert call("add", '{"a": 2, "b": 3}').observation[0]["content"] == (
        "<tool_response>\n5\n</tool_response>"
    )
    obs, _, done, info = call("boom")
    assert "RuntimeError: boom 1" in obs[0]["content"] and info["tool_errors"] == 1 and not done
    start = time.perf_counter()
    obs, _, _, info = call("hang")
    assert time.perf_counter() - start < 5 and "did not finish within 1 s" in obs[0]["content"]
    obs, _, _, _ = call("huge")
    assert "1000000 characters in all" in obs[0]["content"] and len(obs[0]["content"]) < 2200
    assert "noise" not in obs[0]["content"]
    assert call("add", '{"a": 1, "b": 1}').observation[0]["content"].count("2") == 1  # recovered
    assert call("nope").info["tool_errors"] == 1
    assert env.step("<tool_call>{not json</tool_call>").info["tool_errors"] == 1
    assert env.step("The answer is 5.") == (None, 1.0, True, {"success": True, "tool_calls": 0})


@pytest.mark.fast
def test_tool_runner_reports_a_dead_child():
    runner = ToolRunner()
    out, failed = runner.call("os:_exit", {"status": 3}, 5.0, 100)
    assert failed and "exit code 3" in out
    assert runner.call("env_fns:add", {"a": 1, "b": 2}, 5.0, 100) == ("3", False)
    runner.close()


def test_calculator_environment_on_the_tiny_model(engine, prompts):
    batch, _ = rollout(engine, prompts.take([0, 1]), environment="calculator", max_turns=2)
    assert batch["messages"][0][0]["role"] == "system"
    assert "calculator" in batch["messages"][0][0]["content"]


@pytest.mark.fast
def test_calculator_tool():
    from hybrid_engine.rollout.envs.builtin_tools import calculator

    assert calculator("12 * (3 + 4) - 2 ** 3") == "76" and calculator("7 / 2") == "3.5"
    with pytest.raises(ValueError, match="not arithmetic"):
        calculator("__import__('os')")


@pytest.mark.fast
def test_config_names_the_environment_and_refuses_what_multi_turn_cannot_do():
    with pytest.raises(ConfigError, match="rollout.multi_turn.environment='nope'.*feedback"):
        load_config(PRESET, ["rollout.multi_turn.environment=nope"])
    with pytest.raises(ConfigError, match="cannot be loaded"):
        load_config(PRESET, ["rollout.multi_turn.environment=env_fns:Missing"])
    with pytest.raises(ConfigError, match="overlong_buffer_len"):
        load_config(PRESET, ["reward.overlong_buffer_len=4"])
    assert load_config(PRESET).max_response_length == 96


def test_dynamic_sampling_and_rollout_correction_take_trajectories():
    cfg = load_config(
        PRESET,
        [
            "rollout.multi_turn.environment=env_fns:TwoTurns",
            "reward.function=reward_fns:length_score",
            "algorithm.filter_groups.enabled=true",
            "algorithm.filter_groups.metric=score",
            "algorithm.rollout_correction.level=token",
        ],
    )
    metrics = Engine(cfg).step(1)
    assert metrics["dynamic_sampling/kept_groups"] >= cfg.data.train_batch_size
    assert metrics["multi_turn/turns/mean"] == 2.0
    # the rollout log-probs of policy tokens equal the trainer's on the CPU (observations: 0 and 0)
    assert abs(metrics["rollout_corr/rollout_is_mean"] - 1.0) < 1e-3
    assert metrics["rollout_corr/kl"] < 1e-5
    assert metrics["rollout/logprob_gap_max"] < 1e-3  # the step logs the gap itself


def test_a_template_that_takes_tools_renders_them_and_gets_tool_messages(engine, prompts):
    import copy

    tok = copy.deepcopy(engine.tokenizer)
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    env = make_environment("calculator", {})
    env.use_tokenizer(tok)
    assert env.protocol == "template" and env.template_tools[0]["function"]["name"] == "calculator"
    row = {k: prompts[k][0] for k in prompts.non_tensors}
    assert env.reset(row, 0) == row["prompt"]  # nothing added: the template shows the tools
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 21"}}</tool_call>'
    assert env.step(call).observation == [{"role": "tool", "content": "42"}]
    batch = multi_turn_rollout(
        engine.actor.generate, tok, prompts.take([0]), [env], SamplingParams(8, 0.0), 2, 96, 512
    )
    assert "TOOLS [{" in tok.decode(batch["prompt_ids"][0]) and '"calculator"' in tok.decode(
        batch["prompt_ids"][0]
    )
