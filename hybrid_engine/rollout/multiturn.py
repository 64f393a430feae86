"""Multi-turn rollout: the policy and one environment per trajectory take turns.

    for turn in 1..max_turns:
        every open trajectory's context (prompt + all turns so far) -> one batched generate
        each new assistant turn -> env.step(text) -> observation, reward, done
        a trajectory that is done, at max_turns, or out of max_total_tokens drops out

A trajectory is one sequence: the prompt (the chat-templated messages `env.reset` returned,
generation prompt included), then assistant tokens (exactly as sampled) interleaved with
observation tokens (the template's text between the end of the assistant's message and the
start of the next one: `observation_ids`). `response_mask` is 1 on the policy's tokens and 0
on observation tokens; `attention_mask` is 1 on both, so log-probs see the whole context and
losses count only what the policy wrote. With the `hf` backend's prefix cache
(`rollout.prefix_cache_mb`) a turn prefills only the tokens added since the last one. Everything is a function of the rows, the seeds and the
weights: the same call gives the same trajectories.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from hybrid_engine.batch import Batch
from hybrid_engine.rewards import token_level_scores
from hybrid_engine.rollout.base import PREFIX_COUNTS, SamplingParams
from hybrid_engine.rollout.envs import Environment, Messages, make_environment
from hybrid_engine.step_metrics import combined_metrics

Generate = Callable[[Batch, SamplingParams], Batch]
TURN_SEED_STRIDE = 1_000_003  # turn k samples with seed + (k - 1) * stride


@dataclass
class Trajectory:
    env: Environment
    messages: Messages
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # after the prompt: assistant + observation
    mask: list[int] = field(default_factory=list)  # 1 on the policy's tokens
    log_probs: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)  # each turn's last policy token
    rewards: list[float | None] = field(default_factory=list)  # each turn's env reward
    tool_turns: int = 0  # turns that called a tool
    tool_calls: int = 0
    tool_errors: int = 0
    success: bool | None = None
    stop: str = ""  # done | max_turns | max_total_tokens
    final_text: str = ""

    @property
    def open(self) -> bool:
        return not self.stop


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    tools: list[dict[str, Any]] | None,
    generation_prompt: bool,
) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turn_closing(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text the chat template writes after an assistant message's content."""
    probe = "zq-probe-zq"
    text = render(
        tokenizer,
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": probe}],
        None,
        False,
    )
    return text[text.rindex(probe) + len(probe) :]


def observation_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    observation: Messages,
    tools: list[dict[str, Any]] | None,
    ended_with_eos: bool,
    closing: list[int],
) -> list[int]:
    """The tokens between the assistant's last sampled token and the next assistant turn's
    first: the rest of the template's closing of the assistant message (`closing`, the tokens
    of `turn_closing`; all of it when the turn was cut before EOS), the observation messages,
    and the generation prompt. `messages` ends with the assistant's message."""
    before = render(tokenizer, messages, tools, False)
    after = render(tokenizer, messages + observation, tools, True)
    if not after.startswith(before):
        raise ValueError(
            "the chat template renders a conversation differently once a message is added, so "
            "a multi-turn trajectory cannot be one token sequence with this tokenizer"
        )
    if ended_with_eos and closing[:1] == [tokenizer.eos_token_id]:
        closing = closing[1:]
    return closing + encode(tokenizer, after[len(before) :])


def multi_turn_rollout(
    generate: Generate,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Batch,
    envs: list[Environment],
    sampling: SamplingParams,
    max_turns: int,
    max_total_tokens: int,
    max_prompt_length: int,
    on_turn: Callable[[int], None] | None = None,
) -> Batch:
    """Trajectories for the rows of `prompts` (one environment each, seeded `sampling.seed
    + row`), `sampling.max_new_tokens` per assistant turn. `on_turn(k)` after turn k."""
    env_s = 0.0
    trajs = []
    for i, env in enumerate(envs):
        row = {k: prompts[k][i] for k in prompts.non_tensors}
        start = time.perf_counter()
        if hasattr(env, "use_tokenizer"):
            env.use_tokenizer(tokenizer)
        messages = env.reset(row, sampling.seed + i)
        env_s += time.perf_counter() - start
        tools = getattr(env, "template_tools", None)
        ids = encode(tokenizer, render(tokenizer, messages, tools, True))
        if len(ids) > max_prompt_length:
            raise ValueError(
                f"prompt of row {i} ({row.get('data_source')}) has {len(ids)} tokens with the "
                f"environment's messages, more than data.max_prompt_length={max_prompt_length}"
            )
        trajs.append(Trajectory(env, messages, tools, ids))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    closing = encode(tokenizer, turn_closing(tokenizer))
    gen_s, turn_rows, turn_metrics, reshard_s = 0.0, [], [], 0.0
    recorded = True  # every turn's call returned its log-probs (vllm always does)
    prefix = dict.fromkeys(PREFIX_COUNTS, 0)
    for turn in range(1, max_turns + 1):
        active = [t for t in trajs if t.open]
        if not active:
            break
        turn_rows.append(len(active))
        budgets = [max_total_tokens - len(t.ids) for t in active]
        ctx = left_padded([t.prompt_ids + t.ids for t in active], pad)
        turn_sampling = replace(
            sampling,
            max_new_tokens=min(sampling.max_new_tokens, max(budgets)),
            seed=sampling.seed + (turn - 1) * TURN_SEED_STRIDE,
            keep_prefixes=turn < max_turns,  # the next turn starts with these tokens
            reuse_prefixes=turn > 1,
        )
        out = generate(Batch(ctx), turn_sampling)
        gen_s += out.meta["gen_seconds"]
        turn_metrics.append(out.meta.get("rollout_metrics", {}))  # a backend's own (vllm: push)
        reshard_s += out.meta.get("reshard_s", 0.0)
        for key in prefix:
            prefix[key] += out.meta.get(key, 0)
        lps = out.tensors.get("rollout_log_probs")
        recorded = recorded and lps is not None
        for j, (t, budget) in enumerate(zip(active, budgets, strict=True)):
            n = min(int(out["response_mask"][j].sum()), budget)
            new = out["response_ids"][j, :n].tolist()
            t.ids += new
            t.mask += [1] * n
            t.log_probs += lps[j, :n].tolist() if lps is not None else [0.0] * n
            t.turn_ends.append(len(t.ids) - 1)
            t.final_text = tokenizer.decode(new, skip_special_tokens=True)
            t.messages.append({"role": "assistant", "content": t.final_text})
            start = time.perf_counter()
            try:
                obs, reward, done, info = t.env.step(t.final_text)
            except Exception as e:
                raise RuntimeError(
                    f"environment {type(t.env).__name__} failed at turn {turn} of row "
                    f"{trajs.index(t)} ({t.env!r}): {type(e).__name__}: {e}"
                ) from e
            env_s += time.perf_counter() - start
            t.rewards.append(None if reward is None else float(reward))
            calls = int(info.get("tool_calls", 0))
            t.tool_calls += calls
            t.tool_turns += calls > 0
            t.tool_errors += int(info.get("tool_errors", 0))
            if "success" in info:
                t.success = bool(info["success"])
            if done or not obs:
                t.stop = "done"
            elif turn == max_turns:
                t.stop = "max_turns"
            else:
                obs_ids = observation_ids(
                    tokenizer, t.messages, obs, t.tools, bool(new) and new[-1] == eos, closing
                )
                if len(t.ids) + len(obs_ids) >= max_total_tokens:  # no room left to answer
                    t.stop = "max_total_tokens"
                else:
                    t.ids += obs_ids
                    t.mask += [0] * len(obs_ids)
                    t.log_probs += [0.0] * len(obs_ids)
                    t.messages += obs
        if on_turn is not None:
            on_turn(turn)
    for t in trajs:
        if callable(close := getattr(t.env, "close", None)):
            close()
    batch = trajectories_batch(prompts, trajs, pad, recorded, gen_s, env_s, turn_rows)
    batch.meta.update(prefix, reshard_s=reshard_s, rollout_metrics=combined_metrics(turn_metrics))
    return batch


def env_rollout(
    generate: Generate,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Batch,
    sampling: SamplingParams,
    mt: Any,
    max_prompt_length: int,
    on_turn: Callable[[int], None] | None = None,
) -> Batch:
    """`multi_turn_rollout` with a new environment per row, as `rollout.multi_turn` says."""
    envs = [make_environment(mt.environment, mt.env_kwargs) for _ in range(len(prompts))]
    return multi_turn_rollout(
        generate,
        tokenizer,
        prompts,
        envs,
        sampling,
        mt.max_turns,
        mt.max_total_tokens,
        max_prompt_length,
        on_turn,
    )


def left_padded(rows: list[list[int]], pad: int) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return {"prompt_ids": ids, "prompt_mask": mask}


def trajectories_batch(
    prompts: Batch,
    trajs: list[Trajectory],
    pad: int,
    with_log_probs: bool,
    gen_s: float,
    env_s: float,
    turn_rows: list[int],
) -> Batch:
    """The rollout batch: tensors as a single-turn rollout has them (response = everything
    after the prompt), the conversations and their counts as per-sample fields."""
    width = max(len(t.ids) for t in trajs)

    def right(rows: list[list], value: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)

    prompt = left_padded([t.prompt_ids for t in trajs], pad)
    response_ids = right([t.ids for t in trajs], pad, torch.long)
    response_mask = right([t.mask for t in trajs], 0, torch.long)
    seen = right([[1] * len(t.ids) for t in trajs], 0, torch.long)
    tensors = {
        **prompt,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt["prompt_ids"], response_ids], 1),
        "attention_mask": torch.cat([prompt["prompt_mask"], seen], 1),
    }
    if with_log_probs:
        tensors["rollout_log_probs"] = right([t.log_probs for t in trajs], 0.0, torch.float32)
    rewards = [[r for r in t.rewards if r is not None] for t in trajs]
    fields = {
        **prompts.non_tensors,
        "messages": [t.messages for t in trajs],
        "final_response": [t.final_text for t in trajs],
        "turns": [len(t.turn_ends) for t in trajs],
        "turn_ends": [t.turn_ends for t in trajs],
        "turn_rewards": [t.rewards for t in trajs],
        "env_reward": [r[-1] if r else None for r in rewards],
        "success": [t.success for t in trajs],
        "tool_turns": [t.tool_turns for t in trajs],
        "tool_calls": [t.tool_calls for t in trajs],
        "tool_errors": [t.tool_errors for t in trajs],
        "stop": [t.stop for t in trajs],
    }
    tokens = int(response_mask.sum())
    meta = {
        "gen_tokens": tokens,
        "gen_seconds": gen_s,
        "gen_tokens_per_s": tokens / max(gen_s, 1e-9),
        "env_seconds": env_s,
        "turn_rows": turn_rows,
    }
    return Batch(tensors, fields, {**prompts.meta, **meta})


STOPS = ("done", "max_turns", "max_total_tokens")


def multi_turn_metrics(
    batch: Batch, prefix: str = "multi_turn/", stops: tuple[str, ...] = STOPS
) -> dict[str, float]:
    """Turns, tool use, success and stop reasons of a multi-turn batch."""
    n = len(batch)
    turns = sum(batch["turns"])
    calls = sum(batch["tool_calls"])
    known = [s for s in batch["success"] if s is not None]
    out = {
        f"{prefix}turns/mean": turns / n,
        f"{prefix}tool_call_rate": sum(batch["tool_turns"]) / max(turns, 1),
        f"{prefix}tool_calls/mean": calls / n,
        f"{prefix}tool_error_rate": sum(batch["tool_errors"]) / calls if calls else 0.0,
        f"{prefix}observation_tokens/mean": float(
            (
                batch["attention_mask"][:, -batch["response_mask"].shape[1] :].sum()
                - batch["response_mask"].sum()
            )
            / n
        ),
    }
    if known:
        out[f"{prefix}success_rate"] = sum(known) / len(known)
    if looked_up := batch.meta.get("prefix_lookup_tokens"):  # context tokens not prefilled
        out[f"{prefix}prefix_cache_hit_rate"] = batch.meta["prefix_hit_tokens"] / looked_up
    for reason in stops:
        out[f"{prefix}stop/{reason}"] = batch["stop"].count(reason) / n
    return out


def multi_turn_scores(
    batch: Batch, scored: dict[int, float], per_turn: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores, acc, token_level_scores) of trajectories. A trajectory's score is its last
    environment reward, or `scored[i]` (the scorer on its final answer) when the environment
    gave none; with `per_turn`, each turn's reward sits on that turn's last token and the
    score is their sum. acc = the environment's `success` where it said, else score >= 1."""
    scores = [
        scored[i] if last is None else sum(r or 0.0 for r in turns) if per_turn else last
        for i, (last, turns) in enumerate(
            zip(batch["env_reward"], batch["turn_rewards"], strict=True)
        )
    ]
    token_scores = token_level_scores(scores, batch["response_mask"])  # on the last token
    if per_turn:  # each turn's reward on its own last token instead
        for i, (last, ends, turns) in enumerate(
            zip(batch["env_reward"], batch["turn_ends"], batch["turn_rewards"], strict=True)
        ):
            if last is not None:
                token_scores[i].zero_()
                for end, r in zip(ends, turns, strict=True):
                    token_scores[i, end] += r or 0.0
    score_t = torch.tensor(scores, dtype=torch.float32)
    acc = [s >= 1.0 if ok is None else ok for s, ok in zip(scores, batch["success"], strict=True)]
    return score_t, torch.tensor(acc, dtype=torch.float32), token_scores


def conversation_text(messages: Messages) -> str:
    """A conversation from its first assistant message on, as readable text: one `[role]`
    block per message."""
    first = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), 0)
    return "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in messages[first:])
