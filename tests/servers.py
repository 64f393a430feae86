"""Real servers for the tests, each on 127.0.0.1 and its own free port: Prefect's API
(`prefect server start`), moto's S3 server, and a TCP proxy that can cut the network path
to a server (an S3 outage) and restore it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=2).read()
            return
        time.sleep(0.3)
    raise TimeoutError(f"{url} not up after {timeout_s} s")


def start_prefect(home: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_UI_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    wait_http(f"{url}/health", 120, proc)
    return proc, url


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/moto-api/", 30, proc)
    return proc, url


def start_mlflow(home: Path) -> tuple[subprocess.Popen, str]:
    """`mlflow server` on sqlite, artifacts proxied into `home` (MACHINE-FACTS settings)."""
    port = free_port()
    env = {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    proc = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{home}/mlflow.db",
            "--artifacts-destination",
            str(home / "artifacts"),
            "--workers",
            "1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", 120, proc)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    """The server and anything it started (its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


class TcpProxy:
    """127.0.0.1:<port> -> target. `cut()` closes every connection and refuses new ones (the
    server is gone for the client); `restore()` listens again on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.port = free_port()
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        lst = socket.socket()
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", self.port))
        lst.listen(64)
        self.listener = lst
        threading.Thread(target=self._accept, args=(lst,), daemon=True).start()

    def cut(self) -> None:
        lst, self.listener = self.listener, None
        if lst is not None:
            with contextlib.suppress(OSError):
                lst.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            lst.close()
        with self.lock:
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                c.close()
            self.conns.clear()

    def _accept(self, lst: socket.socket) -> None:
        while True:
            try:
                client, _ = lst.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class ConditionalProxy:
    """An HTTP proxy to an S3 server that plays a store without conditional writes: a PUT's
    `If-None-Match` header is dropped (`mode="ignore"`: the store ignores it) or answered
    501 NotImplemented (`mode="reject"`); everything else is passed through unchanged."""

    def __init__(self, target_port: int, mode: str) -> None:
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                conditional = "if-none-match" in {k.lower() for k in headers}
                if conditional and self.command == "PUT":
                    proxy.seen += 1
                    if mode == "reject":
                        msg = b"<Error><Code>NotImplemented</Code><Message>no</Message></Error>"
                        self.send_response(501)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(msg)))
                        self.end_headers()
                        self.wfile.write(msg)
                        return
                    headers = {k: v for k, v in headers.items() if k.lower() != "if-none-match"}
                up = http.client.HTTPConnection("127.0.0.1", target_port, timeout=30)
                up.request(self.command, self.path, body=body, headers=headers)
                resp = up.getresponse()
                data = resp.read()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                up.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.seen = 0  # conditional PUTs seen
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
