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
    """The registered names of every kind, one table per kind. The one place the docs import
    the registries from: when they change form, only this function changes."""
    from typing import get_args

    from hybrid_engine.algorithms import ADV_ESTIMATORS, POLICY_LOSSES, estimator_needs
    from hybrid_engine.algorithms.losses import LOSS_AGG_MODES
    from hybrid_engine.config import KLKind, RolloutConfig
    from hybrid_engine.envs import ENVIRONMENTS

    needs = {
        "values": "a critic",
        "index": "prompt groups (`rollout.n` ≥ 2)",
        "reward_baselines": "a greedy rollout per prompt",
    }

    def first_line(obj: object) -> str:
        return " ".join((obj.__doc__ or "").strip().split("\n\n")[0].split())

    def table(title: str, intro: str, header: list[str], rows: list[list[str]]) -> list[str]:
        lines = [f"## {title}", "", intro, "", "| " + " | ".join(header) + " |"]
        lines.append("|" + " --- |" * len(header))
        return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]

    estimators = [
        [
            f"`{n}`",
            ", ".join(needs[k] for k in sorted(estimator_needs(n))) or "—",
            first_line(ADV_ESTIMATORS[n]),
        ]
        for n in sorted(ADV_ESTIMATORS)
    ]
    losses = [
        [
            f"`{n}`",
            f"`{s.aggregation}` always" if s.aggregation else "`actor.loss_agg_mode`",
            s.summary,
        ]
        for n, s in sorted(POLICY_LOSSES.items())
    ]
    envs = [[f"`{n}`", first_line(ENVIRONMENTS[n])] for n in sorted(ENVIRONMENTS)]
    backends = get_args(RolloutConfig.model_fields["name"].annotation)
    out = table(
        "Advantage estimators",
        '`algorithm.adv_estimator`; your own: `@register_adv_estimator("name")` in a module '
        "listed in `algorithm.plugins`.",
        ["name", "needs", "what"],
        estimators,
    )
    out += table(
        "Policy losses",
        '`actor.policy_loss.mode`; your own: `@register_policy_loss("name")` in a module '
        "listed in `algorithm.plugins`.",
        ["name", "reduces tokens by", "what"],
        losses,
    )
    out += table(
        "Loss aggregation modes",
        "`actor.loss_agg_mode` and `critic.loss_agg_mode`.",
        ["name"],
        [[f"`{n}`"] for n in LOSS_AGG_MODES],
    )
    out += table(
        "KL estimators",
        "`algorithm.kl_penalty` (in the reward) and `actor.kl_loss_type` (in the loss).",
        ["name"],
        [[f"`{n}`"] for n in get_args(KLKind)],
    )
    out += table(
        "Environments",
        '`rollout.multi_turn.environment`; your own: `@register_environment("name")` in a '
        "module listed in `algorithm.plugins`, or a class named as `module:Class`.",
        ["name", "what"],
        envs,
    )
    out += table("Rollout backends", "`rollout.name`.", ["name"], [[f"`{n}`"] for n in backends])
    return "\n".join(out)


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
