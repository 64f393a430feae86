"""MkDocs hook (mkdocs.yml `hooks:`): the reference pages are written from the code while the
site builds, never kept by hand.

A page holds a marker, `<!-- generated: NAME -->`, where NAME is a key of `GENERATORS`; the
marker is replaced by that generator's markdown. A marker without a generator fails the build.
The benchmarks' plots in `bench/results/` are served as `assets/bench/<name>.png`, so the
pages show the files the benchmarks wrote rather than copies.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # this checkout's packages, ahead of any installed copy
    sys.path.insert(0, str(REPO))

MARKER = re.compile(r"<!-- generated: ([a-z_]+) -->")


def configuration() -> str:
    """Every configuration key (default, type, meaning) from the config model itself; each
    section's bold title becomes a heading, so the page's table of contents lists them."""
    from hybrid_engine.config import config_reference

    text = escape(config_reference())
    return re.sub(r"^\*\*([a-z_.]+)\*\*$", r"## \1", text, flags=re.MULTILINE)


def registry_tables() -> str:
    """The registered names of every kind, one table per registry, from the registries."""
    from hybrid_engine.config import registries_reference

    return escape(registries_reference())


def escape(markdown: str) -> str:
    """`<` and `>` outside code spans as entities: help texts say `<run_id>` in plain text,
    which a browser would otherwise take for a tag."""
    parts = markdown.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def cli() -> str:
    """Every command of `hybridrl` from the typer app: usage, help, arguments and options.
    The click objects are used by their attributes only (typer ships its own click)."""
    import typer

    from flows.cli import app

    out: list[str] = []

    def cell(text: object) -> str:
        return escape(" ".join(str(text).split())).replace("|", "\\|")

    def row(param, ctx) -> str | None:
        record = param.get_help_record(ctx)  # what `--help` prints: (usage, help)
        if record is None or getattr(param, "hidden", False):
            return None
        usage, meaning = record
        return f"| `{usage}` | {cell(meaning)} |"

    def walk(cmd, parent, name: str) -> None:
        ctx = cmd.context_class(cmd, info_name=name, parent=parent)
        path = ctx.command_path
        if parent is not None:  # the root's own help is the page's opening
            out.extend([f"## {path}", ""])
        usage = f"{path} {' '.join(cmd.collect_usage_pieces(ctx))}".rstrip()
        out.extend(["```", usage, "```", ""])
        if cmd.help:
            out.extend([escape(cmd.help.strip()), ""])
        rows = [r for r in (row(p, ctx) for p in cmd.params) if r]
        if rows:
            out.extend(["| argument / option | meaning |", "| --- | --- |", *rows, ""])
        if cmd.epilog and parent is None:
            out.extend([cmd.epilog.strip(), ""])
        for sub in getattr(cmd, "list_commands", lambda _: [])(ctx):
            walk(cmd.get_command(ctx, sub), ctx, sub)

    walk(typer.main.get_command(app), None, "hybridrl")
    return "\n".join(out)


GENERATORS: dict[str, Callable[[], str]] = {
    "configuration": configuration,
    "cli": cli,
    "registries": registry_tables,
}


def on_files(files, config):
    from mkdocs.structure.files import File

    for png in sorted((REPO / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"assets/bench/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files):
    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise KeyError(f"{page.file.src_uri}: no generator named {name!r} in {__file__}")
        return GENERATORS[name]()

    return MARKER.sub(fill, markdown)
