"""Tool calls in a separate process, with a time limit.

A tool is a plain function named `module:function`. `ToolRunner.call` sends the call as one
JSON line to a child Python process (this file run as a script: it imports nothing but the
tool's module, ~0.05 s to start), which imports the tool's module (once; not counted in the
limit) and answers with one JSON line, after at most `timeout_s` seconds of the call.
A tool that raises returns its exception as text; one that hangs (or loops) is killed with
its process, which the next call replaces (~0.1 s). Either way the caller gets an
observation, never an exception. Output past `max_chars` is cut in the child, so a tool that
returns megabytes sends back only the cut text and its full length. What a tool prints goes
to /dev/null (stdout carries the protocol).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Any

LOAD_TIMEOUT_S = 120.0  # importing a tool's module (a cold one may import torch)


def cut(text: str, max_chars: int) -> str:
    """`text`, or its first `max_chars` characters and a note of its full length."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[output cut: {len(text)} characters in all]"


class ToolRunner:
    """One child process serving tool calls, one at a time (restarted after a timeout)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.pending = b""  # read from the child, not yet a whole line

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        return subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            bufsize=0,
        )

    def call(
        self, fn: str, arguments: dict[str, Any], timeout_s: float, max_chars: int
    ) -> tuple[str, bool]:
        """(output text, whether it is an error) of `fn(**arguments)`."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        request = {"fn": fn, "arguments": arguments, "max_chars": max_chars}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            # first the import of the tool's module (not timed as the call), then the call
            loaded = self._read(LOAD_TIMEOUT_S)
            line = self._read(timeout_s) if loaded == "loaded\n" else loaded
        except (BrokenPipeError, OSError):
            line = ""
        if line is None:
            self.close()
            return f"error: {fn.rpartition(':')[2]} did not finish within {timeout_s:g} s", True
        if not line:
            code = self.close()
            return f"error: the tool process ended without an answer (exit code {code})", True
        reply = json.loads(line)
        return reply["output"], not reply["ok"]

    def _read(self, timeout_s: float) -> str | None:
        """The child's next line ("" once it has died), or None after `timeout_s`. Reads the
        pipe's descriptor itself: a buffered reader may hold the next line where `select`
        cannot see it."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return ""
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode() + "\n"

    def close(self) -> int | None:
        """Kill the child (if any); its exit code."""
        proc, self.proc, self.pending = self.proc, None, b""
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        return proc.wait()


_RUNNER: ToolRunner | None = None


def runner() -> ToolRunner:
    """This process's tool runner (started on first use)."""
    global _RUNNER
    if _RUNNER is None:
        _RUNNER = ToolRunner()
    return _RUNNER


def load_tool(spec: str) -> Any:
    """The function `module:function` names."""
    from hybrid_engine.specs import load_spec  # light: the child imports it too

    return load_spec(spec, "tool")


def _serve() -> None:
    """The child: answer JSON-line requests on stdin until it closes."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # what tools print must not reach the protocol
    for line in sys.stdin:
        req = json.loads(line)
        try:
            fn = load_tool(req["fn"])
        except BaseException as e:  # noqa: BLE001 - reported as the call's error
            fn, out, ok = None, f"error: {type(e).__name__}: {e}", False
        else:
            protocol.write("loaded\n")
        if fn is not None:
            try:
                out, ok = str(fn(**req["arguments"])), True
            except BaseException as e:  # noqa: BLE001 - a tool's failure is its observation
                out, ok = f"error: {type(e).__name__}: {e}", False
        protocol.write(json.dumps({"ok": ok, "output": cut(out, req["max_chars"])}) + "\n")


if __name__ == "__main__":
    _serve()
