"""`hybridrl runs ...`: training runs as MLflow tracked them (list, show, compare) and as
storage holds them (tree of forks, delete what no fork uses)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from flows.cli.options import StorageRoot, TrackingUri, as_overrides

# Markup off: messages, run ids, tags and table cells are the user's text, printed as written
# (rich would read "[vllm]" as a tag and drop it); styles are given as `style=` or `Text`.
console = Console(markup=False)
runs_app = typer.Typer(help="Training runs: as MLflow tracked them, and their forks in storage.")


def fail(e: Exception) -> None:
    """One red line naming the problem, exit status 1."""
    console.print(Text.assemble(("error:", "red"), f" {e}"), soft_wrap=True)
    raise typer.Exit(1) from None


Experiment = Annotated[str, typer.Option("--experiment", help="MLflow experiment")]


@runs_app.command("list")
def runs_list(tracking_uri: TrackingUri = None, experiment: Experiment = "hybridrl") -> None:
    """Every run: id, status, steps, last score and validation accuracy, start time."""
    import datetime

    from rich.table import Table

    from storage.tracking.tracker import TrackingUnavailable, list_runs

    try:
        runs = list_runs(tracking_uri, experiment)
    except TrackingUnavailable as e:
        fail(e)
    if not runs:
        console.print(f"no runs in MLflow experiment {experiment!r}")
        return
    table = Table(title=f"experiment {experiment!r}")
    for col in ("run", "status", "steps", "score", "val/accuracy", "started", "mlflow run id"):
        table.add_column(col)
    for r in runs:
        m = r.data.metrics
        started = datetime.datetime.fromtimestamp(r.info.start_time / 1000)
        table.add_row(
            r.data.tags.get("hybridrl.run_id", r.info.run_name),
            r.info.status,
            r.data.params.get("trainer.total_training_steps", "-"),
            f"{m['critic/score/mean']:.3f}" if "critic/score/mean" in m else "-",
            f"{m['val/accuracy']:.3f}" if "val/accuracy" in m else "-",
            started.strftime("%Y-%m-%d %H:%M"),
            r.info.run_id,
        )
    console.print(table)


@runs_app.command("show")
def runs_show(
    run_id: str, tracking_uri: TrackingUri = None, experiment: Experiment = "hybridrl"
) -> None:
    """One run: tags (storage, checkpoint, Prefect flow run) and its last metrics."""
    from storage.tracking.tracker import TrackingUnavailable, find_run

    try:
        run = find_run(tracking_uri, run_id, experiment)
    except (LookupError, TrackingUnavailable) as e:
        fail(e)
    console.print(
        Text.assemble((run_id, "bold"), f"  {run.info.status}  mlflow run {run.info.run_id}")
    )
    for k, v in sorted(run.data.tags.items()):
        if k.startswith(("hybridrl.", "prefect.")):
            console.print(f"  {k:<24} {v}")
    for k, v in sorted(run.data.metrics.items()):
        console.print(f"  {k:<40} {v:.4g}")


@runs_app.command("compare")
def runs_compare(
    run_a: str, run_b: str, tracking_uri: TrackingUri = None, experiment: Experiment = "hybridrl"
) -> None:
    """Two runs side by side: the config keys that differ, then their last metrics."""
    from rich.table import Table

    from storage.tracking.tracker import (
        CURVE_KEYS,
        TrackingUnavailable,
        compare,
        curves_from,
        find_run,
        fork_point,
        ui_hint,
    )

    try:
        a, b = (find_run(tracking_uri, r, experiment) for r in (run_a, run_b))
    except (LookupError, TrackingUnavailable) as e:
        fail(e)
    params, metrics = compare(a, b)
    for title, rows in (("config differences", params), ("last metrics", metrics)):
        table = Table(title=title)
        for col in ("key", run_a, run_b):
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    if forked := fork_point(a, b):  # a parent and its fork: the curves where they part
        step, which = forked
        table = Table(
            title=f"from the fork point (step {step}; the fork is "
            f"{run_a if which == 'a' else run_b})"
        )
        table.add_column("step")
        for key in CURVE_KEYS:
            table.add_column(f"{key}\n{run_a}")
            table.add_column(f"{key}\n{run_b}")
        for row in curves_from(tracking_uri, a, b, step):
            table.add_row(*row)
        console.print(table)
    hint = ui_hint(tracking_uri, [a.info.run_id, b.info.run_id], a.info.experiment_id)
    console.print(f"MLflow UI: {hint}", soft_wrap=True)


def _storage(root: str | None):  # noqa: ANN202 - a StorageConfig
    from hybrid_engine.config import load_config

    return load_config(None, as_overrides(root, None)).storage


@runs_app.command("tree")
def runs_tree(run_id: str, storage_root: StorageRoot = None) -> None:
    """A run's lineage: its ancestors, then every fork of it (and of its forks) with the
    fork point and what the fork changed. Read from storage (run.json of each run)."""
    from rich.tree import Tree

    from storage.catalog import runs_under

    runs = runs_under(_storage(storage_root))
    if run_id not in runs:
        fail(FileNotFoundError(f"no run {run_id!r} under {_storage(storage_root).root}"))

    def label(r: str) -> Text:
        doc, lin = runs[r], runs[r].get("lineage") or {}
        steps = doc["config"]["trainer"]["total_training_steps"]
        text = Text.assemble((r, "bold"), f"  {steps} steps")
        if lin:
            changes = ", ".join(f"{k}={v}" for k, v in lin.get("overrides", {}).items())
            text.append(f"  forked at {lin['at']}" + (f": {changes}" if changes else ""))
        if doc.get("deleted"):
            text.append("  (deleted; kept for its forks)", "red")
        return text

    top = run_id
    while (p := (runs[top].get("lineage") or {}).get("parent")) in runs:
        top = p
    tree = Tree(label(top))

    def grow(node: Tree, r: str) -> None:
        for child, doc in runs.items():
            if (doc.get("lineage") or {}).get("parent") == r:
                grow(node.add(label(child)), child)

    grow(tree, top)
    console.print(tree)


@runs_app.command("delete")
def runs_delete(
    run_id: str,
    storage_root: StorageRoot = None,
    yes: Annotated[bool, typer.Option("--yes", help="do not ask")] = False,
) -> None:
    """Delete a run's stored stages, checkpoints and final policy, except what its forks
    still reference (kept, and removed with the last fork that uses it); its MLflow run is
    marked deleted. A deleted run cannot be resumed or forked."""
    from storage.catalog import delete_run
    from storage.store import RunStore

    cfg = _storage(storage_root)
    doc = RunStore(cfg, run_id).read_run()
    if doc is None or doc.get("deleted"):
        fail(FileNotFoundError(f"no run {run_id!r} under {cfg.root}"))
    if not yes and not typer.confirm(f"delete run {run_id} under {cfg.root}?"):
        raise typer.Exit(1)
    got = delete_run(cfg, run_id)
    mb = 1024 * 1024
    console.print(f"run {run_id}: removed {got['removed_bytes'] / mb:.1f} MiB")
    if got["kept"]:
        forks = sorted({f for v in got["kept"].values() for f in v})
        console.print(
            f"kept {len(got['kept'])} stage/checkpoint directories "
            f"({got['kept_bytes'] / mb:.1f} MiB) that forks {', '.join(forks)} use"
        )
    for parent in got["also_removed"]:
        console.print(f"removed deleted run {parent}: no fork uses its objects any more")
    if doc.get("mlflow_run_id") and doc.get("mlflow_tracking_uri"):
        try:
            from storage.tracking.tracker import client_for

            client_for(doc["mlflow_tracking_uri"]).delete_run(doc["mlflow_run_id"])
            console.print(f"MLflow run {doc['mlflow_run_id']} marked deleted")
        except Exception as e:  # the store moved or is down: the storage side is done
            console.print(
                f"MLflow run {doc['mlflow_run_id']} not marked deleted: {e}", style="yellow"
            )
