"""A remote judge for the benchmarks: an HTTP reward server on 127.0.0.1 that answers after a
set latency, and the reward function that asks it.

    .venv/bin/python bench/judge.py --latency 6 --preset configs/demo_cpu.yaml [--port 0]

The server prints `listening on http://127.0.0.1:PORT` and scores each POST to `/score`
(`{"completions": [...], "rows": [...]}`) with the project's built-in scorer for the
preset's task (reasoning-gym's own `score_answer`), sleeping `--latency` seconds per request
first, as a grader model behind an API would. Requests are served concurrently, so runs that
share the judge do not queue behind one another.

A run uses it as its reward (`PYTHONPATH=bench`):

    HYBRIDRL_JUDGE_URL=http://127.0.0.1:PORT hybridrl train configs/demo_cpu.yaml \
        reward.function=judge:score
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

URL_ENV = "HYBRIDRL_JUDGE_URL"


def score(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
    """`reward.function=judge:score`: the judge at $HYBRIDRL_JUDGE_URL scores the batch."""
    url = os.environ.get(URL_ENV)
    if not url:
        raise RuntimeError(f"${URL_ENV} is not set: start bench/judge.py and export its URL")
    body = json.dumps({"completions": completions, "rows": rows}, default=str).encode()
    req = urllib.request.Request(
        f"{url}/score", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())["scores"]


def serve(latency_s: float, preset: str, port: int = 0) -> None:
    """Serve `/score` on 127.0.0.1:`port` (0: a free one) until interrupted."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hybrid_engine.config import load_config
    from hybrid_engine.rewards import builtin_score

    cfg = load_config(preset)
    fmt, task_config = cfg.reward.answer_format, cfg.data.task_config

    class Judge(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(latency_s)
            scores = [
                builtin_score(text, row, fmt, task_config)
                for text, row in zip(req["completions"], req["rows"], strict=True)
            ]
            out = json.dumps({"scores": scores}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args) -> None:  # one line per request would flood the bench
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Judge)
    print(f"listening on http://127.0.0.1:{server.server_port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    ap.add_argument("--preset", default="configs/demo_cpu.yaml", help="the task it scores")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    serve(a.latency, a.preset, a.port)
