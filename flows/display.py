"""The live display of `hybridrl train` / `resume` on a terminal: two lines under the log.

    ⠙ run grpo-tiny-1130  ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━  2/4  0:01:02  ETA 0:01:00
    ⠙ step 3 rollout      412 tokens · 135 tok/s                                         0:00:03

The first line counts steps, with an ETA from the mean wall time of the steps this process
computed (steps read back from storage do not count). The second names the stage running
now; during a rollout (hf backend, in-process or the Ray pool) it polls the engine for the
response tokens sampled so far. It listens to `tasks.progress` events.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

POLL_S = 0.5


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _all_handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    return [h for lg in loggers for h in getattr(lg, "handlers", [])]


class _AboveLive(io.TextIOBase):
    """A text file whose lines (ANSI colours kept) print above the live display."""

    def __init__(self, console: Console) -> None:
        self.console, self.partial = console, ""

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self.console.print(Text.from_ansi(line), soft_wrap=True)
        return len(text)

    def isatty(self) -> bool:
        return True


class _StepBar(BarColumn):
    """The bar on the steps line only."""

    def render(self, task: Any) -> Any:
        return super().render(task) if task.fields.get("kind") == "steps" else ""


class LiveDisplay:
    """A `tasks.progress` listener drawing the run's steps and the current stage."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}", markup=False),  # run ids are the user's text
            _StepBar(),
            TextColumn("{task.fields[count]}"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[eta]}"),
            console=console,
        )
        self.steps: Any = None
        self.stage: Any = None
        self.step_began: float | None = None
        self.computed: list[float] = []  # wall seconds of steps computed by this process
        self.fresh = False  # the current step computed at least one stage
        self.total = 0
        self.poll_s = POLL_S
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def __enter__(self) -> LiveDisplay:
        self.progress.start()  # from here on, writes to sys.stderr print above the lines
        self._swapped: list[tuple[Any, Any]] = []
        self._redirect_logs()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop_polling()
        for console, file in self._swapped:
            console.file = file
        self.progress.stop()

    def _redirect_logs(self) -> None:
        """Prefect's console handler prints with its own rich Console to the real stderr
        (rich does not write through its redirect): print its lines above ours instead."""
        for h in _all_handlers():
            console = getattr(h, "console", None)
            if isinstance(console, Console) and not isinstance(console.file, _AboveLive):
                self._swapped.append((console, console.file))
                console.file = _AboveLive(self.progress.console)

    # ------------------------------------------------------------- events
    def run_started(self, run_id: str, start: int, total: int) -> None:
        self._redirect_logs()
        self.total = total
        self.steps = self.progress.add_task(
            f"run {run_id}",
            total=total,
            completed=start - 1,
            eta="",
            kind="steps",
            count=f"{start - 1}/{total}",
        )

    def stage_started(self, step: int, stage: str, engine: Any) -> None:
        if self.step_began is None and step > 0:
            self.step_began, self.fresh = time.perf_counter(), False
        what = f"step {step} {stage}"
        if self.stage is None:
            self.stage = self.progress.add_task(what, total=None, eta="", kind="stage", count="")
        else:
            self.progress.reset(self.stage, description=what, total=None)
        if stage in ("rollout", "validate"):
            self._start_polling(engine, what)

    def stage_finished(self, step: int, stage: str, seconds: float, skipped: bool) -> None:
        self._stop_polling()
        self.fresh = self.fresh or not skipped
        done = "from storage" if skipped else f"done in {seconds:.1f} s"
        self.progress.update(self.stage, description=f"step {step} {stage}: {done}")

    def step_finished(self, step: int, metrics: dict[str, Any], line: str) -> None:
        if self.step_began is not None and self.fresh:
            self.computed.append(time.perf_counter() - self.step_began)
        self.step_began = None
        eta = ""
        if self.computed:
            mean = sum(self.computed) / len(self.computed)
            eta = f"ETA {_clock(mean * (self.total - step))}  ({mean:.1f} s/step)"
        self.progress.update(self.steps, completed=step, eta=eta, count=f"{step}/{self.total}")

    # ------------------------------------------------------------- rollout tokens
    def _start_polling(self, engine: Any, what: str) -> None:
        self._stop.clear()

        def poll() -> None:
            while not self._stop.wait(self.poll_s):
                try:
                    got = engine.rollout_progress()
                except Exception:  # the display only; the stage reports its own errors
                    return
                if got and got["seconds"] > 0:
                    rate = got["tokens"] / got["seconds"]
                    self.progress.update(
                        self.stage, description=f"{what}  {got['tokens']} tokens · {rate:.0f} tok/s"
                    )

        self._poller = threading.Thread(target=poll, name="hybridrl-progress", daemon=True)
        self._poller.start()

    def _stop_polling(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=10)
            self._poller = None


def _fmt(m: dict[str, Any], key: str, spec: str = ".3f") -> str:
    return format(m[key], spec) if key in m else "-"


def step_line(step: int, m: dict[str, Any], results: list[Any]) -> str:
    skipped = [f"{r.stage} (replayed)" if r.replayed else r.stage for r in results if r.skipped]
    return (
        f"step {step:>4}  score {_fmt(m, 'critic/score/mean')}  "
        f"val_acc {_fmt(m, 'val/accuracy')}  pg_loss {_fmt(m, 'actor/pg_loss', '+.4f')}  "
        f"entropy {_fmt(m, 'actor/entropy')}  len {_fmt(m, 'response_length/mean', '.1f')}  "
        f"gen {_fmt(m, 'perf/tokens_per_s_rollout', '.0f')} tok/s  "
        f"{_fmt(m, 'timing_s/step', '.1f')} s"
        + (f"  (from storage: {', '.join(skipped)})" if skipped else "")
    )


def held_out_line(validation: list[tuple[int, float]], wall_s: float) -> str:
    """The run's held-out accuracy before training and at its last validation (and its best,
    when that was earlier), then the command's wall time: what a user looks at first."""
    clock = f"wall time {_clock(wall_s)}"
    if not validation:
        return f"no validation ran (trainer.test_freq, trainer.val_before_train); {clock}"
    before = [f"{a:.1%} before training" for step, a in validation if step == 0]
    trained = [(step, a) for step, a in validation if step > 0]
    after = [f"{trained[-1][1]:.1%} at step {trained[-1][0]}"] if trained else []
    line = "held-out accuracy: " + " -> ".join(before + after)
    best = max(trained, key=lambda v: v[1], default=None)
    if best is not None and best[1] > trained[-1][1]:
        line += f" (best {best[1]:.1%} at step {best[0]})"
    return f"{line}; {clock}"
