"""`hybridrl` driver processes without their start-up cost.

A driver process spends seconds importing torch, transformers, Ray and Prefect before its
flow starts; the suite starts about a hundred. Here they are forked from a server process
that imported those modules once (the standard library's multiprocessing "forkserver"). Each
driver is still its own OS process, in its own session, running `flows.cli` with its own
arguments, environment, working directory and output: a fault point's SIGKILL, a SIGTERM, an
exit status and what the CLI prints are those of a real process.

What a forked driver cannot take from its own environment is what the server fixed when it
imported: Prefect's settings (`PREFECT_*`, read at import) and Ray's (`RAY_*`). A driver whose
environment differs from the server's in those starts as a plain subprocess instead.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
from multiprocessing import forkserver
from pathlib import Path
from unittest.mock import patch

ROOT = Path(__file__).parents[1]
# the server's imports, in this order (hybrid_engine and tasks set Ray's and Prefect's
# environment defaults before those are imported; ray is named, as no module above imports
# it at the top, so that it reads RAY_ here, as FIXED says): what a driver imports first
PRELOAD = ["hybrid_engine", "ray", "tasks", "flows.cli", "flows.train", "mlflow", "s3fs"]
FIXED = ("PREFECT_", "RAY_")  # environment read at import: a forked driver cannot change it
_lock = threading.Lock()
_server: tuple[multiprocessing.context.BaseContext, dict[str, str]] | None = None


def _fixed(env: dict[str, str]) -> dict[str, str]:
    """`env`'s settings read at import, as a driver process with it would see them (the
    defaults `hybrid_engine` and `tasks` set where `env` has none)."""
    from hybrid_engine import RAY_ENV
    from tasks import PREFECT_ENV

    return {k: v for k, v in {**RAY_ENV, **PREFECT_ENV, **env}.items() if k.startswith(FIXED)}


def _context(env: dict[str, str]):
    """The fork server, started (once) with `env`'s fixed part; None if `env` differs from
    the running server's."""
    global _server
    with _lock:
        if _server is None and not env.get("PREFECT_API_URL"):
            return None  # a server is made for the flows' drivers, which share one API
        wanted = _fixed(env)
        if _server is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            base = {k: v for k, v in env.items() if k != "HYBRIDRL_FAULT"}
            with patch.dict(os.environ, base, clear=True):  # the server inherits this one
                forkserver.ensure_running()
            _server = (ctx, wanted)
        ctx, fixed = _server
        if wanted == fixed:
            return ctx
        differ = sorted(k for k in {*fixed, *wanted} if fixed.get(k) != wanted.get(k))
        print(
            f"[drivers] a plain subprocess: {differ} differ from the fork server's", file=sys.stderr
        )
        return None


def _run_cli(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked process: what `python -m flows.cli ARGV` would do, in a new session,
    stdout to `out` and stderr to `err` (the same file: interleaved as in one pipe)."""
    os.setsid()
    for path, fd in ((out, 1), (err, 2)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    for sig in (signal.SIGTERM, signal.SIGINT):  # a fresh interpreter's dispositions
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    sys.argv = ["hybridrl", *argv]
    from flows.cli import app

    code: int | str | None = 0
    try:
        app(args=argv, prog_name="hybridrl")
    except SystemExit as e:
        code = e.code
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends a child with os._exit: run them here
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


class Driver:
    """A `hybridrl` process, forked (see the module's docstring) or a plain subprocess;
    `pid` leads its own process group."""

    def __init__(
        self, argv: list[str], env: dict[str, str], cwd: Path = ROOT, merged: bool = True
    ) -> None:
        ctx = _context(env)
        if ctx is None:
            self._popen = subprocess.Popen(
                [sys.executable, "-m", "flows.cli", *argv],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if merged else subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            self.pid = self._popen.pid
            return
        self._popen = None
        self._dir = tempfile.TemporaryDirectory(prefix="hybridrl-driver-")
        self._out = os.path.join(self._dir.name, "out")
        self._err = self._out if merged else os.path.join(self._dir.name, "err")
        self._proc = ctx.Process(target=_run_cli, args=(argv, env, str(cwd), self._out, self._err))
        self._proc.start()
        self.pid = self._proc.pid

    def poll(self) -> int | None:
        if self._popen is not None:
            return self._popen.poll()
        return self._proc.exitcode

    def wait(self, timeout: float) -> tuple[int, str, str]:
        """(exit status: -N for signal N, stdout, stderr); the group is killed and
        `subprocess.TimeoutExpired` raised if it runs past `timeout` seconds."""
        if self._popen is not None:
            try:
                out, err = self._popen.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill_group()
                self._popen.communicate(timeout=30)
                raise
            return self._popen.returncode, out, err or ""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            self.kill_group()
            self._proc.join(30)
            raise subprocess.TimeoutExpired(["hybridrl"], timeout, self._read(self._out))
        out = self._read(self._out)
        err = "" if self._err == self._out else self._read(self._err)
        self._dir.cleanup()
        return self._proc.exitcode, out, err

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    @staticmethod
    def _read(path: str) -> str:
        with open(path, errors="replace") as f:
            return f.read()
