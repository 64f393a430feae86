"""The OpenAI-compatible endpoint the policy serves while agent episodes run.

    POST /e/<key>/v1/chat/completions   a call of the episode whose key is <key>: the client
                                        given to that episode's agent has this base_url
    GET  /v1/models, /e/<key>/v1/models the one model served

Calls are not generated one at a time. `Hub` holds them until no episode is running its own
code (each one waits for a call's answer, or has ended, or waits for a free slot); then the
rollout's thread takes them all as one batch (`take_batch`), generates, and answers them
(`answer`). This lock-step makes the batches the same in every run; with a seed per call and
per choice (`call_seed`), the samples are too. FastAPI and uvicorn serve on 127.0.0.1, in an
event loop on a thread of their own, which also runs the agents (`runner`).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hybrid_engine.rollout.agent.chat import BadRequest, ChatRequest, template_messages
from hybrid_engine.rollout.agent.episodes import Call, Episode

MODEL_ID = "hybridrl-policy"


@dataclass
class Pending:
    episode: int
    call: Call
    req: ChatRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def call_seed(seed: int, episode: int, call: int, choice: int) -> int:
    """The sampling seed of one choice of one call: a function of where it sits in the step,
    not of the batch it was generated in."""
    return (((seed * 1_000_003 + episode) * 1_000_003 + call) * 64 + choice) % 2**63


class Hub:
    """What the endpoint's handlers (event-loop thread) and the rollout (its own thread)
    share, under one condition variable. An episode is queued, running (its agent's own
    code), waiting (for a call's answer) or done."""

    def __init__(
        self,
        episodes: list[Episode],
        prepare: Callable[[list[Call], list[dict], list[dict] | None], tuple[list[int], Any]],
        max_context: int,
        version: int,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> None:
        self.cond = threading.Condition()
        self.episodes = episodes
        self.status = ["queued"] * len(episodes)
        self.since = [0.0] * len(episodes)  # when each last started running its own code
        self.own = [0.0] * len(episodes)  # seconds each ran its own code before that
        self.pending: list[Pending] = []
        self.keys = {secrets.token_hex(8): i for i in range(len(episodes))}
        self.key_of = {i: k for k, i in self.keys.items()}
        self.prepare, self.max_context, self.version = prepare, max_context, version
        self.top_p, self.top_k = top_p, top_k  # the rollout's: a call may not set others
        self.calls_made = [0] * len(episodes)

    # ------------------------------------------------------------ event-loop side
    async def serve(self, key: str, body: Any) -> JSONResponse:
        i = self.keys.get(key)
        if i is None:
            return JSONResponse(
                BadRequest("unknown_episode", "no episode has this key").body(), 404
            )
        loop = asyncio.get_running_loop()
        with self.cond:
            if self.status[i] == "done":
                return JSONResponse(
                    BadRequest("episode_ended", f"episode {i} has ended").body(), 409
                )
            ep = self.episodes[i]
            try:
                req = ChatRequest.parse(body)
                req.check_sampling(self.top_p, self.top_k)
                messages = template_messages(req)
                try:
                    prompt_ids, extends = self.prepare(ep.calls, messages, req.tools)
                except Exception as e:  # the chat template raised: the request's fault
                    raise BadRequest(
                        "template_error",
                        f"the chat template cannot render these messages: "
                        f"{type(e).__name__}: {str(e)[:200]}",
                        "messages",
                    ) from None
                if len(prompt_ids) > self.max_context:
                    raise BadRequest(
                        "context_length",
                        f"the prompt has {len(prompt_ids)} tokens, more than "
                        f"rollout.agent.max_context_tokens={self.max_context}",
                        "messages",
                    )
            except BadRequest as e:
                if not ep.fault:
                    ep.fault, ep.detail = e.reason, e.message
                return JSONResponse(e.body(), 400)
            call = Call(self.calls_made[i], messages, req.tools, prompt_ids, extends, self.version)
            self.calls_made[i] += 1
            future = loop.create_future()
            self.pending.append(Pending(i, call, req, future, loop))
            if self.status[i] == "running":
                self.own[i] += time.monotonic() - self.since[i]
            self.status[i] = "waiting"
            self.cond.notify_all()
        status, result = await future
        return JSONResponse(result, status)

    # ------------------------------------------------------------ rollout side
    def start(self, i: int) -> None:
        self.status[i], self.since[i] = "running", time.monotonic()

    def finish(self, i: int, reward: float | None, info: dict, fault: str, detail: str) -> bool:
        """Episode i has ended (its agent returned, raised or timed out); False if it had
        ended already. A fault its requests recorded first is kept."""
        with self.cond:
            if self.status[i] == "done":
                return False
            ep = self.episodes[i]
            if fault and not ep.fault:
                ep.fault, ep.detail = fault, detail
            if not ep.fault and not ep.calls:
                ep.fault, ep.detail = "no_calls", "the agent made no call to the endpoint"
            if not ep.fault:
                ep.reward, ep.info = reward, info
            self.status[i] = "done"
            gone = [p for p in self.pending if p.episode == i]
            self.pending = [p for p in self.pending if p.episode != i]
            for p in gone:
                self._reply(p, 409, BadRequest("episode_ended", f"episode {i} ended").body())
            self.cond.notify_all()
            return True

    def take_batch(
        self, admit: Callable[[], None], timeout_s: float, on_overdue: Callable[[int], None]
    ) -> list[Pending] | None:
        """The next batch of calls (in episode, call order) once no episode is running its
        own code, or None when all have ended. `admit()` starts queued episodes; an episode
        whose own code has run more than `timeout_s` in all (time waiting for answers not
        counted) is ended by `on_overdue(i)`."""
        with self.cond:
            while True:
                admit()
                running = [i for i, s in enumerate(self.status) if s == "running"]
                if not running:
                    if all(s == "done" for s in self.status):
                        return None
                    if self.pending:
                        batch = sorted(self.pending, key=lambda p: (p.episode, p.call.index))
                        self.pending = []
                        return batch
                now = time.monotonic()
                late = [i for i in running if self.own[i] + now - self.since[i] > timeout_s]
                if late:
                    self.cond.release()
                    try:
                        for i in late:
                            on_overdue(i)
                    finally:
                        self.cond.acquire()
                    continue
                self.cond.wait(0.25)

    def answer(self, batch: list[Pending], answers: list[tuple[int, dict]]) -> None:
        """Record the generated calls under their episodes and send the answers; an episode
        whose calls are all answered runs its own code again."""
        with self.cond:
            for p, (status, body) in zip(batch, answers, strict=True):
                if self.status[p.episode] == "done":
                    continue
                ep = self.episodes[p.episode]
                if status == 200:
                    ep.calls.append(p.call)
                elif not ep.fault:  # the completion could not be made into a message
                    ep.fault, ep.detail = body["error"]["code"], body["error"]["message"]
                if not any(q.episode == p.episode for q in self.pending):
                    self.status[p.episode] = "running"
                    self.since[p.episode] = time.monotonic()
                self._reply(p, status, body)
            self.cond.notify_all()

    @staticmethod
    def _reply(p: Pending, status: int, body: dict) -> None:
        def settle() -> None:
            if not p.future.done():
                p.future.set_result((status, body))

        p.loop.call_soon_threadsafe(settle)


def make_app(hub: Hub) -> FastAPI:
    app = FastAPI(title="hybridrl agent endpoint", docs_url=None, redoc_url=None)
    models = {
        "object": "list",
        "data": [{"id": MODEL_ID, "object": "model", "owned_by": "hybridrl"}],
    }

    @app.get("/v1/models")
    @app.get("/e/{key}/v1/models")
    async def list_models(key: str = "") -> dict:
        return models

    @app.post("/e/{key}/v1/chat/completions")
    async def chat(key: str, request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            body = None
        return await hub.serve(key, body)

    @app.post("/v1/chat/completions")
    async def no_episode() -> JSONResponse:
        err = BadRequest(
            "unknown_episode",
            "calls must come through the client given to the agent function: its base_url "
            "names the episode",
        )
        return JSONResponse(err.body(), 400)

    return app


class Server:
    """uvicorn serving `app` on 127.0.0.1 (a free port) in an event loop on its own thread;
    `loop` also runs the agents. A context manager."""

    def __init__(self, app: FastAPI) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="agent-loop", daemon=True)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)

    def __enter__(self) -> Server:
        self.thread.start()
        self.serving = asyncio.run_coroutine_threadsafe(
            self.server.serve(sockets=[self.sock]), self.loop
        )
        deadline = time.monotonic() + 30
        while not self.server.started:
            if self.serving.done():
                self.serving.result()  # raises what stopped it
            if time.monotonic() > deadline:
                raise RuntimeError("the agent endpoint did not start within 30 s")
            time.sleep(0.005)
        return self

    def url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.port}/e/{key}/v1"

    def __exit__(self, *exc: object) -> None:
        """Ask uvicorn to stop and return: it stops within ~0.2 s (its loop polls), then the
        event loop stops and the thread ends on their own."""
        self.server.should_exit = True
        self.serving.add_done_callback(lambda _: self.loop.call_soon_threadsafe(self.loop.stop))
