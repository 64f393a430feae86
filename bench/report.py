"""What every benchmark's report carries: the machine it ran on, and its files written the
same way (`<name>.json`, `<name>.md`, `<name>.png` in one folder)."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo; the platform's processor elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine() -> str:
    """The line a figure names its machine by: CPU model and core count."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


def write_report(
    folder: str | Path,
    name: str,
    report: dict[str, Any],
    table: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], None] | None = None,
) -> None:
    """`report` as JSON, its Markdown `table` and, given `plot`, its figure, in `folder`;
    the table is printed too."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    (out / f"{name}.md").write_text(table(report))
    if plot is not None:
        plot(report, out / f"{name}.png")
    print(table(report))
