"""The OpenAI chat-completions format the agent endpoint speaks.

    request body -> `ChatRequest` (checked; a bad field is named)
    request.messages -> `template_messages` (what the chat template renders; the checks an
                        OpenAI server makes: roles, content parts, tool calls against `tools`)
    sampled text -> `parse_completion` (content and tool calls, by the template's convention)
    -> `completion_response` (the `chat.completion` object)

A refused request raises `BadRequest` with a reason (`malformed_request`, `malformed_message`,
`unknown_tool`, `context_length`, `template_error`, `unsupported_sampling`;
`malformed_completion` for a sampled text the tokenizer's `response_template` cannot parse)
that the rollout counts as the episode's fault.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybrid_engine.rollout.envs.tools import parse_tool_calls

ROLES = {"system", "developer", "user", "assistant", "tool"}


class BadRequest(Exception):
    """A request the endpoint refuses (HTTP 400), with the reason counted as a fault."""

    def __init__(self, reason: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.param = reason, message, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": self.param,
                "code": self.reason,
            }
        }


class ChatRequest(BaseModel):
    """The fields of `POST /v1/chat/completions` the endpoint honours; others are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = ""  # any string: the endpoint serves one policy
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    stream: bool | None = False

    @classmethod
    def parse(cls, body: Any) -> ChatRequest:
        """The request, or `BadRequest` naming the first bad field."""
        if not isinstance(body, dict):
            raise BadRequest("malformed_request", "the request body must be a JSON object")
        try:
            req = cls.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise BadRequest("malformed_request", f"{where}: {err['msg']}", where) from None
        if req.stream:
            raise BadRequest(
                "malformed_request", "stream: not supported by this endpoint", "stream"
            )
        if req.top_logprobs:
            raise BadRequest(
                "malformed_request",
                "top_logprobs: only the sampled token's log-prob is recorded (use 0)",
                "top_logprobs",
            )
        return req

    def check_sampling(self, top_p: float, top_k: int) -> None:
        """Refuse a top_p or top_k other than the rollout's: the update's log-probs are those
        of the full softmax at the call's temperature, which a truncated sample was not
        drawn from."""
        k = (self.model_extra or {}).get("top_k")
        if self.top_p is not None and self.top_p != top_p:
            raise BadRequest(
                "unsupported_sampling",
                f"top_p: a call's own top_p ({self.top_p}) is not trained on; omit it or use "
                f"rollout.top_p ({top_p})",
                "top_p",
            )
        if k is not None and not (k == top_k or (k in (0, -1) and top_k == 0)):
            raise BadRequest(
                "unsupported_sampling",
                f"top_k: a call's own top_k ({k}) is not trained on; omit it or use "
                f"rollout.top_k ({top_k})",
                "top_k",
            )

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop or [] if s]

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_names(self) -> set[str]:
        names = set()
        for i, tool in enumerate(self.tools or []):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise BadRequest(
                    "malformed_request", f"tools.{i}: needs function.name", f"tools.{i}"
                )
            names.add(fn["name"])
        return names


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(
                    "malformed_message",
                    f"{where}.{j}: only text content parts are supported, not {kind!r}",
                    f"{where}.{j}",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise BadRequest(
        "malformed_message", f"{where}: must be a string or a list of text parts", where
    )


def _tool_calls(calls: Any, names: set[str], where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls in the template's form (arguments as a dict)."""
    if not isinstance(calls, list):
        raise BadRequest("malformed_message", f"{where}: must be a list", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(
                "malformed_message", f"{where}.{j}: needs function.name", f"{where}.{j}"
            )
        if fn["name"] not in names:
            raise BadRequest(
                "unknown_tool",
                f"{where}.{j}: tool {fn['name']!r} is not among the request's tools "
                f"({', '.join(sorted(names)) or 'none'})",
                f"{where}.{j}",
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError as e:
                raise BadRequest(
                    "malformed_message",
                    f"{where}.{j}.function.arguments: not JSON ({e})",
                    f"{where}.{j}",
                ) from None
        if not isinstance(args, dict):
            raise BadRequest(
                "malformed_message",
                f"{where}.{j}.function.arguments: must be a JSON object",
                f"{where}.{j}",
            )
        out.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def template_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them, checked the way an OpenAI
    server checks them. Equal conversations give equal lists (the endpoint compares them to
    find a call that continues the previous one)."""
    names = req.tool_names()
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(
                "malformed_message",
                f"{where}.role: {role!r} is not one of {', '.join(sorted(ROLES))}",
                f"{where}.role",
            )
        msg: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": _text(m.get("content"), f"{where}.content"),
        }
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], names, f"{where}.tool_calls")
            call_ids |= {c["id"] for c in msg["tool_calls"]}
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or cid not in call_ids:
                raise BadRequest(
                    "malformed_message",
                    f"{where}.tool_call_id: {cid!r} answers no earlier assistant tool call",
                    f"{where}.tool_call_id",
                )
            msg["tool_call_id"] = cid
        elif m.get("content") is None and role != "assistant":
            raise BadRequest("malformed_message", f"{where}.content: missing", f"{where}.content")
        out.append(msg)
    if out[-1]["role"] == "assistant":
        raise BadRequest(
            "malformed_message",
            f"messages.{len(out) - 1}: the last message is the assistant's; continuing it is "
            "not supported",
            f"messages.{len(out) - 1}",
        )
    return out


def parse_completion(
    tokenizer: Any, text: str, prompt_ids: list[int], req: ChatRequest, call_id: str
) -> dict[str, Any]:
    """The assistant message of a sampled `text`: tool calls parsed when the request offers
    tools (and `tool_choice` is not "none") by the tokenizer's `response_template`
    (transformers' `parse_response`) where it has one, else by the `<tool_call>{json}
    </tool_call>` convention. Text with a block that is not valid JSON or names a tool the
    request does not offer stays content, with no tool calls; text the `response_template`
    cannot parse raises `BadRequest` (`malformed_completion`)."""
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if not req.tools or req.tool_choice == "none":
        return msg
    if getattr(tokenizer, "response_template", None) is not None:
        try:
            parsed = tokenizer.parse_response(text, prefix=prompt_ids, tools=req.tools)
        except Exception as e:  # the policy's text does not fit the template's format
            raise BadRequest(
                "malformed_completion",
                f"the tokenizer's response_template cannot parse the completion: "
                f"{type(e).__name__}: {str(e)[:200]}",
            ) from None
        calls = [
            (c["function"]["name"], c["function"].get("arguments") or {})
            for c in parsed.get("tool_calls") or []
        ]
        content = parsed.get("content") or ""
    else:
        found = parse_tool_calls(text)
        calls = [c for c in found if not isinstance(c, str)]
        content = text
        if calls and len(calls) == len(found):
            content = text.split("<tool_call>")[0].strip()
    if calls and all(name in req.tool_names() for name, _ in calls):
        msg["content"] = content
        msg["tool_calls"] = [
            {
                "id": f"{call_id}-{j}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            for j, (name, args) in enumerate(calls)
        ]
    return msg


def wire_message(msg: dict[str, Any]) -> dict[str, Any]:
    """A template message in OpenAI's wire form (tool-call arguments as JSON text)."""
    out = {"role": "assistant", "content": msg["content"] or None}
    if msg.get("tool_calls"):
        out["tool_calls"] = [
            {
                **c,
                "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])},
            }
            for c in msg["tool_calls"]
        ]
    return out


def completion_response(
    call_id: str,
    model: str,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    tokenizer: Any,
    with_logprobs: bool,
) -> dict[str, Any]:
    """The `chat.completion` object; `choices`: {message, finish_reason, ids, log_probs}."""
    out = []
    for k, c in enumerate(choices):
        logprobs = None
        if with_logprobs:
            logprobs = {
                "content": [
                    {
                        "token": tokenizer.convert_ids_to_tokens(t),
                        "logprob": lp,
                        "bytes": list(tokenizer.decode([t]).encode()),
                        "top_logprobs": [],
                    }
                    for t, lp in zip(c["ids"], c["log_probs"], strict=True)
                ]
            }
        finish = c["finish_reason"]
        if c["message"].get("tool_calls") and finish == "stop":
            finish = "tool_calls"
        out.append(
            {
                "index": k,
                "message": wire_message(c["message"]),
                "finish_reason": finish,
                "logprobs": logprobs,
            }
        )
    completion = sum(len(c["ids"]) for c in choices)
    return {
        "id": f"chatcmpl-{call_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        },
    }
