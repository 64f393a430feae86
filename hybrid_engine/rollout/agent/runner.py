"""Agent rollouts: the user's agent function, once per sample, against the policy's endpoint.

    for each row (rollout.n per prompt), at most max_concurrency at once:
        reward = function(client, row, **kwargs)   # async: AsyncOpenAI; def: OpenAI, a thread
    meanwhile, on this thread: take the waiting calls as one batch -> generate -> answer
    episodes -> sequences (token-exact, `episodes`) -> the rollout batch

An agent returns a real number (Python, numpy or a 0-d torch scalar; a bool is 0/1; NaN and
inf are bad returns), a dict with `reward` (and `info`: `success`, counts), or None to let
the reward stage score the episode's final answer. An agent that raises (any BaseException),
runs its own code past `timeout_s` (time its calls wait for generation not counted; an agent
blocking the event loop stalls the others, which time out too), returns anything else, sends
a request the endpoint refuses or makes no call is a fault: counted by reason, named in one
log line, its sample scored 0 or dropped (`on_fault`). Nothing stops the rollout. A finished
episode is handed to `log.save` at once, and one `log.load` gives back is not run again: a
rollout killed midway resumes with those episodes as they were.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import httpx
import openai
import torch

from hybrid_engine.batch import Batch
from hybrid_engine.rewards import as_reward
from hybrid_engine.rollout.agent.chat import BadRequest, completion_response, parse_completion
from hybrid_engine.rollout.agent.endpoint import Hub, Pending, Server, call_seed, make_app
from hybrid_engine.rollout.agent.episodes import Choice, Episode, episodes_batch, prompt_for
from hybrid_engine.rollout.base import PREFIX_COUNTS, SamplingParams
from hybrid_engine.rollout.multiturn import encode, left_padded, turn_closing
from hybrid_engine.specs import load_spec

log = logging.getLogger("hybridrl.agent")
Generate = Callable[[Batch, SamplingParams], Batch]
CLOSE_WAIT_S = 2.0  # the longest wait for the event loop to close the agents' HTTP client


class EpisodeLog(Protocol):
    """Where finished episodes go as they finish (the rollout task commits them)."""

    def load(self, i: int) -> dict[str, Any] | None: ...
    def save(self, i: int, episode: dict[str, Any]) -> None: ...


class BadReturn(Exception):
    pass


def outcome(value: Any) -> tuple[float | None, dict[str, Any]]:
    """(reward, info) of what an agent returned; `BadReturn` for anything else."""
    if value is None:
        return None, {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise BadReturn(f"a dict without 'reward' (keys {sorted(value)})")
        info = value.get("info") or {}
        if not isinstance(info, dict):
            raise BadReturn(f"info of type {type(info).__name__}, not a dict")
        reward, _ = outcome(value["reward"])
        return reward, info
    try:
        return as_reward(value), {}
    except ValueError as e:
        raise BadReturn(str(e)) from None


def in_thread(loop: asyncio.AbstractEventLoop, work: Callable[[], Any]) -> asyncio.Future:
    """`work()` on a new daemon thread, as a future of `loop`. A thread of its own per episode:
    one that hangs past its timeout holds no worker another episode needs."""
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # timed out and cancelled meanwhile
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def target() -> None:
        try:
            value, error = work(), None
        except BaseException as e:  # SystemExit included: the episode's fault
            value, error = None, e
        loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=target, name="agent-episode", daemon=True).start()
    return future


def agent_rollout(
    generate: Generate,
    tokenizer: Any,
    prompts: Batch,
    sampling: SamplingParams,
    agent: Any,
    version: int,
    episode_log: EpisodeLog | None = None,
    on_episode: Callable[[int], None] | None = None,
) -> Batch:
    """Episodes for the rows of `prompts` with `agent` (`rollout.agent`): each call samples
    at most `sampling.max_new_tokens` with the call's temperature (the rollout's where the
    call gives none; a call's own top_p or top_k is refused). `on_episode(k)` after the k-th
    episode is saved."""
    fn = load_spec(agent.function, "rollout.agent.function")
    is_async = inspect.iscoroutinefunction(fn)
    rows = [{k: prompts[k][i] for k in prompts.non_tensors} for i in range(len(prompts))]
    episodes = [Episode() for _ in rows]
    done_before = set()
    for i in range(len(rows)):
        doc = episode_log.load(i) if episode_log is not None else None
        if doc is not None:
            episodes[i] = Episode.from_json(doc)
            done_before.add(i)
    closing = encode(tokenizer, turn_closing(tokenizer))

    def prepare(calls: list, messages: list, tools: list | None) -> tuple[list[int], Any]:
        return prompt_for(tokenizer, calls, messages, tools, closing)

    resumed = set(done_before)
    hub = Hub(episodes, prepare, agent.max_context_tokens, version, sampling.top_p, sampling.top_k)
    for i in done_before:
        hub.status[i] = "done"
    gen_s, saved = 0.0, len(done_before)
    prefix = dict.fromkeys(("calls", *PREFIX_COUNTS), 0)
    # one HTTP connection pool for all the episodes' clients (an openai client of its own
    # builds an SSL context: ~50 ms each)
    limits = httpx.Limits(max_connections=4 * agent.max_concurrency)
    # no read timeout: a call waits as long as its batch takes (timeout_s bounds the agent's
    # own time, `Hub.take_batch`)
    http = (httpx.AsyncClient if is_async else httpx.Client)(limits=limits, timeout=None)
    tasks: dict[int, Any] = {}
    with Server(make_app(hub)) as server:

        async def run(i: int) -> None:
            kind = openai.AsyncOpenAI if is_async else openai.OpenAI
            client = kind(
                base_url=server.url(hub.key_of[i]),
                api_key="hybridrl",
                max_retries=0,
                timeout=None,
                http_client=http,
            )
            reward, info, fault, detail = None, {}, "", ""
            try:
                if is_async:
                    value = await fn(client, rows[i], **agent.kwargs)
                else:
                    value = await in_thread(
                        server.loop, lambda: fn(client, rows[i], **agent.kwargs)
                    )
                reward, info = outcome(value)
            except BadReturn as e:
                fault, detail = "bad_return", f"returned {e}"
            except BaseException as e:  # SystemExit too; a cancel after a timeout is ignored
                fault, detail = "raised", f"{type(e).__name__}: {str(e)[:200]}"
            hub.finish(i, reward, info, fault, detail)

        def admit() -> None:
            active = sum(s in ("running", "waiting") for s in hub.status)
            for i, s in enumerate(hub.status):
                if active >= agent.max_concurrency:
                    break
                if s == "queued":
                    hub.start(i)
                    tasks[i] = asyncio.run_coroutine_threadsafe(run(i), server.loop)
                    active += 1

        def overdue(i: int) -> None:
            detail = (
                f"its own code ran past rollout.agent.timeout_s={agent.timeout_s} (time "
                "waiting for its calls' answers not counted)"
            )
            if hub.finish(i, None, {}, "timeout", detail):
                tasks[i].cancel()  # an async agent stops; a thread cannot be stopped

        while (batch := hub.take_batch(admit, agent.timeout_s, overdue)) is not None:
            start = time.perf_counter()
            answers = generate_calls(generate, tokenizer, batch, sampling, prefix)
            gen_s += time.perf_counter() - start
            hub.answer(batch, answers)
            saved = _save_finished(hub, episodes, done_before, saved, episode_log, on_episode)
        if is_async:
            closing = asyncio.run_coroutine_threadsafe(http.aclose(), server.loop)
            try:  # an agent may still block the loop: its episodes have ended anyway
                closing.result(timeout=CLOSE_WAIT_S)
            except TimeoutError:
                log.warning(
                    "an async agent is blocking its event loop (blocking calls in async "
                    "code); the episodes it stalled were ended as timeouts"
                )
        else:
            http.close()
    _save_finished(hub, episodes, done_before, saved, episode_log, on_episode)
    for i, ep in enumerate(episodes):
        if ep.fault and i not in resumed:
            log.warning(
                "agent episode %d (uid %s): %s: %s; %s",
                i,
                rows[i].get("uid"),
                ep.fault,
                ep.detail,
                "dropped" if agent.on_fault == "drop" else "scored 0",
            )
    batch, metrics = episodes_batch(
        prompts,
        episodes,
        tokenizer,
        agent.on_fault,
        sampling.log_probs,
        gen_s,
        sampling.temperature or 1.0,
    )
    batch.meta["agent_metrics"] = metrics | {"agent/resumed": float(len(resumed))}
    batch.meta.update({k: prefix[k] for k in PREFIX_COUNTS})  # read by multi_turn_metrics
    return batch


def _save_finished(
    hub: Hub,
    episodes: list[Episode],
    done_before: set[int],
    saved: int,
    episode_log: EpisodeLog | None,
    on_episode: Callable[[int], None] | None,
) -> int:
    """Hand each episode that ended since the last call to the log, in episode order."""
    with hub.cond:
        ended = [i for i, s in enumerate(hub.status) if s == "done" and i not in done_before]
    for i in ended:
        if episode_log is not None:
            episode_log.save(i, episodes[i].to_json())
        done_before.add(i)
        saved += 1
        if on_episode is not None:
            on_episode(saved)
    return saved


def generate_calls(
    generate: Generate,
    tokenizer: Any,
    batch: list[Pending],
    sampling: SamplingParams,
    prefix: dict[str, int] | None = None,
) -> list[tuple[int, dict]]:
    """(HTTP status, body) per call: its choices generated in one backend call per distinct
    temperature (the call's, else the rollout's; top_p and top_k are the rollout's), each
    choice with its own seed. Each call records the temperature its log-probs are at: its
    own, 1 for a greedy (0) call, as the backends compute them. `prefix` counts the backend
    calls of the rollout and adds up their prefix-cache counts."""
    groups: dict[float, list[int]] = {}
    for j, p in enumerate(batch):
        t = sampling.temperature if p.req.temperature is None else p.req.temperature
        p.call.temperature = t or 1.0
        groups.setdefault(t, []).append(j)
    choices: list[list[Choice]] = [[] for _ in batch]
    failed: dict[int, BadRequest] = {}
    for t, members in groups.items():
        prompt_rows, seeds, limits, owners = [], [], [], []
        for j in members:
            p = batch[j]
            limit = min(p.req.limit or sampling.max_new_tokens, sampling.max_new_tokens)
            for k in range(p.req.n):
                prompt_rows.append(p.call.prompt_ids)
                seeds.append(call_seed(sampling.seed, p.episode, p.call.index, k))
                limits.append(limit)
                owners.append(j)
        inputs = Batch(
            {
                **left_padded(prompt_rows, tokenizer.pad_token_id),
                "row_seed": torch.tensor(seeds, dtype=torch.long),
            }
        )
        params = replace(sampling, max_new_tokens=max(limits), temperature=t)
        # the episode's next call starts with this context: keep it (freed when training
        # starts); the rollout's first call starts from an empty cache
        reuse = prefix is not None and prefix["calls"] > 0
        out = generate(
            inputs, replace(params, log_probs=True, keep_prefixes=True, reuse_prefixes=reuse)
        )
        if prefix is not None:
            prefix["calls"] += 1
            for key in PREFIX_COUNTS:
                prefix[key] += out.meta.get(key, 0)
        for r, j in enumerate(owners):
            n = min(int(out["response_mask"][r].sum()), limits[r])
            ids = out["response_ids"][r, :n].tolist()
            lps = out["rollout_log_probs"][r, :n].tolist()
            if j in failed:
                continue
            try:
                choices[j].append(_choice(tokenizer, ids, lps, batch[j], len(choices[j])))
            except BadRequest as e:  # malformed_completion: the episode's fault
                failed[j] = e
    answers = []
    for j, (p, cs) in enumerate(zip(batch, choices, strict=True)):
        if j in failed:
            answers.append((500, failed[j].body()))
            continue
        p.call.choices = cs
        body = completion_response(
            f"{p.episode}-{p.call.index}",
            p.req.model,
            [
                {
                    "message": c.message,
                    "finish_reason": c.finish_reason,
                    "ids": c.ids,
                    "log_probs": c.log_probs,
                }
                for c in cs
            ],
            len(p.call.prompt_ids),
            tokenizer,
            bool(p.req.logprobs),
        )
        answers.append((200, body))
    return answers


def _choice(tokenizer: Any, ids: list[int], lps: list[float], p: Pending, k: int) -> Choice:
    """One sampled choice: cut after the token that completes a stop string (the string is
    not in the content), its message parsed for tool calls."""
    eos = tokenizer.eos_token_id
    finish = "stop" if ids and ids[-1] == eos else "length"
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [(text.find(s), s) for s in p.req.stops if s in text]
    if hits:
        pos, stop = min(hits)
        for end in range(1, len(ids) + 1):  # the first token after which the stop is there
            if stop in tokenizer.decode(ids[:end], skip_special_tokens=True):
                ids, lps = ids[:end], lps[:end]
                break
        text, finish = text[:pos], "stop"
    call_id = f"call-{p.episode}-{p.call.index}-{k}"
    message = parse_completion(tokenizer, text, p.call.prompt_ids, p.req, call_id)
    return Choice(ids, lps, message, finish)
