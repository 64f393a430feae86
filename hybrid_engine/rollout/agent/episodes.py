"""Agent episodes as recorded calls, and the training sequences they make.

Every call the endpoint serves is recorded under its episode: the prompt token ids the
policy was given, each choice's sampled token ids and log-probs, and the weights version.
Sampled text is never tokenized again:

    call 1 prompt  = the template's rendering of the messages
    call k prompt  = call k-1's prompt + the sampled ids of the choice the agent kept
                     + the template's text for what came after it (the tool results, the
                     next user message), when the messages extend call k-1's by that
                     choice's message and the template renders the longer conversation as
                     an extension of the shorter one;
                     otherwise the template's rendering alone, and the episode is split.

A sequence is a chain of calls each extending the last: its first prompt is the prompt, the
rest is the response, with `response_mask` 1 on sampled tokens and 0 on the context between
them. An episode gives one sequence per chain end (more than one after a split, or when a
call sampled n > 1 choices and the agent went on with one); all share the episode's reward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hybrid_engine.batch import Batch
from hybrid_engine.rollout.multiturn import (
    Trajectory,
    encode,
    observation_ids,
    render,
    trajectories_batch,
)


@dataclass
class Choice:
    ids: list[int]  # sampled token ids (EOS included when sampled)
    log_probs: list[float]
    message: dict[str, Any]  # the assistant message returned (template form)
    finish_reason: str  # stop | length


@dataclass
class Call:
    index: int
    messages: list[dict[str, Any]]  # template form
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    extends: list[int] | None  # [call, choice] whose sequence this prompt continues
    version: int
    choices: list[Choice] = field(default_factory=list)
    # the temperature of its choices' log-probs: the call's own, 1 for a greedy call; None
    # (recorded before the field existed): the rollout's
    temperature: float | None = None


@dataclass
class Episode:
    """One sample: the calls it made, what the agent returned, and its fault if any."""

    calls: list[Call] = field(default_factory=list)
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    fault: str = ""  # raised | timeout | bad_return | no_calls | a refused request's reason
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Episode:
        calls = [
            Call(**{**c, "choices": [Choice(**ch) for ch in c["choices"]]}) for c in doc["calls"]
        ]
        return cls(calls, doc["reward"], doc["info"], doc["fault"], doc["detail"])


def prompt_for(
    tokenizer: Any,
    calls: list[Call],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    closing: list[int],
) -> tuple[list[int], list[int] | None]:
    """(prompt ids, [call, choice] it extends or None) of a new call of an episode whose
    earlier calls are `calls`; `closing`: the tokens of the template's end of an assistant
    message (`multiturn.turn_closing`)."""
    if calls and calls[-1].tools == tools:
        prev = calls[-1]
        k = len(prev.messages)
        if len(messages) > k + 1 and messages[:k] == prev.messages:
            for c, choice in enumerate(prev.choices):
                if messages[k] != choice.message:
                    continue
                eos = bool(choice.ids) and choice.ids[-1] == tokenizer.eos_token_id
                try:
                    delta = observation_ids(
                        tokenizer, messages[: k + 1], messages[k + 1 :], tools, eos, closing
                    )
                except ValueError:  # the template renders the history differently now
                    break
                return prev.prompt_ids + choice.ids + delta, [prev.index, c]
    return encode(tokenizer, render(tokenizer, messages, tools, True)), None


@dataclass
class Sequence:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    temps: list[float] = field(default_factory=list)  # each token's log-prob temperature
    ends: list[int] = field(default_factory=list)  # each call's last sampled token
    calls: int = 0
    tool_calls: int = 0
    tool_turns: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    final_text: str = ""
    final: bool = False  # it ends with the episode's final answer


def _grow(seq: Sequence, call: Call, choice: Choice, temperature: float) -> Sequence:
    """`seq` continued by `call` (whose prompt extends it) and one of its choices;
    `temperature`: the rollout's log-prob temperature, for a call that recorded none."""
    done = len(seq.prompt_ids) + len(seq.ids)
    context = call.prompt_ids[done:]
    t = temperature if call.temperature is None else call.temperature
    out = Sequence(
        seq.prompt_ids,
        seq.ids + context + choice.ids,
        seq.mask + [0] * len(context) + [1] * len(choice.ids),
        seq.log_probs + [0.0] * len(context) + choice.log_probs,
        seq.temps + [1.0] * len(context) + [t] * len(choice.ids),
        seq.ends,
        seq.calls + 1,
        seq.tool_calls + len(choice.message.get("tool_calls") or []),
        seq.tool_turns + bool(choice.message.get("tool_calls")),
        [*call.messages, choice.message],
        choice.message["content"],
    )
    out.ends = [*seq.ends, len(out.ids) - 1]
    return out


def sequences(calls: list[Call], temperature: float = 1.0) -> tuple[list[Sequence], int]:
    """The training sequences of an episode's calls, and its number of splits (calls that
    start a new sequence although an earlier one exists). The one that ends with the last
    call's first choice, the episode's final answer, is marked `final`."""
    open_: dict[tuple[int, int], Sequence] = {}  # (call, choice) -> the sequence it ends
    splits = 0
    for call in calls:
        if call.extends is None:
            splits += call.index > 0
            base = Sequence(call.prompt_ids)
        else:
            base = open_.pop(tuple(call.extends))
            if (
                call.prompt_ids[: len(base.prompt_ids) + len(base.ids)]
                != base.prompt_ids + base.ids
            ):
                raise AssertionError(f"call {call.index} does not extend its sequence")
        for c, choice in enumerate(call.choices):
            open_[(call.index, c)] = _grow(base, call, choice, temperature)
    if calls and calls[-1].choices:
        open_[(calls[-1].index, 0)].final = True
    return list(open_.values()), splits


def episodes_batch(
    prompts: Batch,
    episodes: list[Episode],
    tokenizer: Any,
    on_fault: str,
    with_log_probs: bool,
    gen_s: float,
    temperature: float = 1.0,
) -> tuple[Batch, dict[str, float]]:
    """The rollout batch of a step's episodes (one per row of `prompts`) and the `agent/`
    metrics. A faulted episode's sequences score 0 (`on_fault: zero`; one with no call is a
    row with an empty response) or are left out (`drop`). Every sequence of an episode has
    the episode's final answer as `final_response` (what the reward stage scores when the
    agent returned None); `episode_final` marks the sequence that ends with it.
    `response_temperature` holds each response token's log-prob temperature (`temperature`,
    the rollout's, for calls recorded without one), which the training side computes its
    log-probs at."""
    rows, trajs, finals, temps, splits, dropped = [], [], [], [], 0, 0
    faults: dict[str, int] = {}
    pad = tokenizer.pad_token_id
    for i, ep in enumerate(episodes):
        if ep.fault:
            faults[ep.fault] = faults.get(ep.fault, 0) + 1
            if on_fault == "drop":
                dropped += 1
                continue
        seqs, n_splits = sequences(ep.calls, temperature)
        splits += n_splits
        if not seqs:  # no call: the prompt and an empty response
            ids = encode(tokenizer, render(tokenizer, prompts["prompt"][i], None, True))
            seqs = [Sequence(ids, [pad], [0], [0.0], [1.0], [])]
        reward = 0.0 if ep.fault else ep.reward
        success = ep.info.get("success")
        final_text = next((s.final_text for s in seqs if s.final), seqs[-1].final_text)
        for s in seqs:
            finals.append(s.final)
            temps.append(s.temps)
            rows.append(i)
            trajs.append(
                Trajectory(
                    env=None,
                    messages=s.messages,
                    tools=None,
                    prompt_ids=s.prompt_ids,
                    ids=s.ids,
                    mask=s.mask,
                    log_probs=s.log_probs,
                    turn_ends=s.ends,
                    rewards=[reward],
                    tool_turns=s.tool_turns,
                    tool_calls=s.tool_calls,
                    success=None if success is None or ep.fault else bool(success),
                    stop="fault" if ep.fault else "done",
                    final_text=final_text,
                )
            )
    if not trajs:
        raise RuntimeError(
            f"every agent episode of the batch faulted ({faults}) and rollout.agent.on_fault="
            "drop left nothing to train on"
        )
    batch = trajectories_batch(prompts.take(rows), trajs, pad, with_log_probs, gen_s, 0.0, [])
    batch["agent_fault"] = [episodes[i].fault for i in rows]
    batch["episode"] = rows
    batch["episode_final"] = finals
    width = batch["response_ids"].shape[1]
    batch["response_temperature"] = torch.tensor(
        [t + [1.0] * (width - len(t)) for t in temps], dtype=torch.float32
    )
    n = len(episodes)
    metrics = {
        "agent/episodes": float(n),
        "agent/sequences": float(len(trajs)),
        "agent/splits": float(splits),
        "agent/calls/mean": sum(len(e.calls) for e in episodes) / n,
        "agent/fault_rate": sum(bool(e.fault) for e in episodes) / n,
        "agent/dropped": float(dropped),
    }
    metrics |= {f"agent/faults/{k}": float(v) for k, v in sorted(faults.items())}
    numeric: dict[str, list[float]] = {}
    for e in episodes:
        for k, v in e.info.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                numeric.setdefault(k, []).append(float(v))
    metrics |= {f"agent/info/{k}/mean": sum(v) / len(v) for k, v in sorted(numeric.items())}
    return batch, metrics
