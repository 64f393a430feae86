"""`hybridrl`: the command line.

    hybridrl train CONFIG [key.path=value ...]   a run as the Prefect `train` flow
    hybridrl resume RUN_ID [storage.root=...]    continue a run where it stopped
    hybridrl runs list|show RUN|compare A B      runs as MLflow tracked them
    hybridrl pool status [--pool NAME]           the persistent workers: version, role, RSS
    hybridrl pool down [--pool NAME]             stop them (and the local Ray head if idle)
    hybridrl deploy [NAME ...]                   deployments/prefect.yaml to $PREFECT_API_URL

`train` prints the run id and one line per step, and leaves the final policy in
`<storage.root>/<run_id>/final/`; on failure it exits 1 with one line naming the problem
(`--debug` shows the traceback).
"""

from __future__ import annotations

import logging
import os
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    add_completion=False,
    rich_markup_mode="markdown",
    help="hybridrl: RL post-training for language models, run as a resumable Prefect pipeline "
    "(rollout → reward → advantage → update per step, each stage committed to storage).",
    epilog="""Examples (from the repository root):

* `hybridrl train configs/grpo_tiny.yaml trainer.total_training_steps=4` — a run in a minute
* `hybridrl train configs/demo_cpu.yaml` — the CPU demo (SmolLM2-135M, arithmetic)
* `hybridrl resume RUN_ID` — continue a run that stopped, where it stopped
* `hybridrl runs compare RUN_A RUN_B` — config differences, last metrics, MLflow UI link
* `hybridrl deploy` — scheduled training on the Prefect server at $PREFECT_API_URL

`hybridrl COMMAND --help` explains each command.""",
)
console = Console()

Overrides = Annotated[
    list[str] | None, typer.Argument(help="dotted overrides: actor.optim.lr=1e-6")
]
Debug = Annotated[bool, typer.Option("--debug", help="show tracebacks")]


class _NoTraceback(logging.Filter):
    """Prefect logs a failed task's or flow's traceback; without --debug one line is enough."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def _run_flow(config: str | None, overrides: list[str], run_id: str | None, resume: bool,
              debug: bool) -> None:  # fmt: skip
    try:
        from hybrid_engine.config import load_config

        if resume:  # the stored config with the overrides, checked as the flow will
            from flows.train import open_run

            cfg, _ = open_run(None, overrides, run_id, resume=True)
        else:
            cfg = load_config(config, overrides)
        if not resume:  # bad input fails here, in a second, before Prefect starts
            from storage.store import new_run_id, validate_run_id

            if cfg.tracking.enabled:  # a server that is down: seconds, not minutes
                from storage.tracking import check_tracking, tracking_uri

                check_tracking(tracking_uri(cfg))
            from flows.preflight import preflight

            preflight(cfg)  # model dirs, data, reward function, storage root: seconds
            run_id = validate_run_id(run_id or cfg.trainer.run_id or new_run_id(config))
            from flows.train import refuse_existing
            from storage.store import RunStore

            refuse_existing(RunStore(cfg.storage, run_id))
            console.print(f"run id: [bold]{run_id}[/]")
        if cfg.trainer.reuse_freed_memory:  # before Prefect starts threads: see its docstring
            from hybrid_engine.workers import reuse_freed_memory

            reuse_freed_memory()
        from flows.train import train as train_flow

        if not debug:
            for handler in logging.getLogger().handlers:  # Prefect's console handler
                handler.addFilter(_NoTraceback())
        kwargs = {"overrides": secrets_to_environment(overrides)}
        kwargs |= {"resume_from": run_id} if resume else {"config": config, "run_id": run_id}
        if console.is_terminal and not debug:  # live steps/stage lines under the log
            from flows.display import LiveDisplay
            from tasks.progress import listening

            with LiveDisplay(console) as display, listening(display):
                result = train_flow(**kwargs)
        else:
            result = train_flow(**kwargs)
        rows = result.get("last", {})
        console.print(f"run {result['run_id']}: {result['steps']} steps recorded")
        if result.get("recoveries"):
            console.print(f"recovered from {result['recoveries']} worker fault(s) on the way "
                          "(run.json: recoveries)")  # fmt: skip
        if "val/accuracy" in rows:
            console.print(f"final val/accuracy: {rows['val/accuracy']:.3f}")
        console.print(f"final policy: {result['uri']}")
        if result.get("pool"):
            console.print(
                f"worker pool {result['pool']!r} stays up for the next run "
                f"(`hybridrl pool status`, `hybridrl pool down --pool {result['pool']}`)"
            )
    except (KeyboardInterrupt, typer.Exit):
        raise
    except Exception as e:
        from prefect.exceptions import CancelledRun

        if isinstance(e, CancelledRun):  # SIGTERM: the flow run ended in state "Preempted"
            console.print(f"[yellow]{e}[/]", soft_wrap=True)
            raise typer.Exit(143) from None
        if debug:
            raise
        console.print(f"[red]error:[/] {type(e).__name__}: {e}", soft_wrap=True)
        raise typer.Exit(1) from None


def secrets_to_environment(overrides: list[str]) -> list[str]:
    """Overrides that carry a secret-looking value (`ray.worker_env={AWS_SECRET_ACCESS_KEY:
    ...}`) go to this process's environment as `HYBRIDRL_<SECTION>__<KEY>` instead of the
    flow's parameters, which Prefect records with the flow run; the flow reads them from
    there (same process). The others are returned."""
    import json

    from hybrid_engine.config import parse_overrides, redact

    kept = []
    for item in overrides:
        parsed = parse_overrides([item])
        if redact(parsed) == parsed:
            kept.append(item)
            continue
        key = item.partition("=")[0].strip()
        value = parsed
        for part in key.split("."):
            value = value[part]
        name = "HYBRIDRL_" + "__".join(p.upper() for p in key.split("."))
        os.environ[name] = value if isinstance(value, str) else json.dumps(value)
    return kept


@app.command()
def train(
    config: Annotated[str, typer.Argument(help="YAML preset, e.g. configs/demo_cpu.yaml")],
    overrides: Overrides = None,
    run_id: Annotated[str | None, typer.Option(help="default: <preset>-<timestamp>")] = None,
    debug: Debug = False,
) -> None:
    """Train a policy with RL: the Prefect `train` flow, each stage checkpointed.

    CONFIG is a YAML preset (configs/); overrides are dotted `key.path=value` pairs (README:
    Configuration lists every key). Prints the run id, live progress and a line per step;
    the final policy lands in `<storage.root>/<run_id>/final/`."""
    _run_flow(config, overrides or [], run_id, False, debug)


@app.command()
def resume(
    run_id: Annotated[str, typer.Argument(help="the run to continue")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="storage.root=... (where the run is), ray.*, more steps, ..."),
    ] = None,
    debug: Debug = False,
) -> None:
    """Continue a run where it stopped: committed stages are skipped, nothing regenerated.

    The run's stored config is used; overrides may change only where things live and run
    (`storage.*`, `ray.*`, `pipeline.*`, `tracking.*`, threads, backend, save/test
    frequency) or train longer (`trainer.total_training_steps`). Give `storage.root=...`
    when the run is not under ./runs."""
    _run_flow(None, overrides or [], run_id, True, debug)


pool_app = typer.Typer(help="The persistent Ray worker pool.")
app.add_typer(pool_app, name="pool")
PoolName = Annotated[str, typer.Option("--pool", help="ray.pool_name of the pool")]


def _checked_pool(pool: str) -> str:
    """`--pool` checked like `ray.pool_name` (one line and exit 1 when it is not a name)."""
    from pydantic import ValidationError

    from hybrid_engine.config import RayConfig

    try:
        RayConfig(pool_name=pool)
    except ValidationError:
        _fail(ValueError(f"--pool {pool!r} is not a pool name (letters, digits, _ . -; "
                         "starting with a letter or digit; at most 63 characters)"))  # fmt: skip
    return pool


def _connect() -> bool:
    from hybrid_engine.config import load_config
    from hybrid_engine.pool import connect

    return connect(load_config(None, []), start=False) is not None


@pool_app.command("status")
def pool_status(pool: PoolName = "default") -> None:
    """Each worker: weights version, role, rank, pid, RSS, health."""
    from rich.table import Table

    from hybrid_engine.pool import pool_status as status

    pool = _checked_pool(pool)
    if not _connect():
        console.print("no Ray cluster: no local head is running and RAY_ADDRESS is not set")
        raise typer.Exit(1)
    workers = status(pool)
    if not workers:
        console.print(f"pool {pool!r} has no workers")
        raise typer.Exit(1)
    table = Table(title=f"pool {pool!r}")
    for col in ("worker", "roles", "rank", "pid", "weights", "rss GB", "peak GB", "health"):
        table.add_column(col)
    for w in workers:
        healthy = w.get("healthy")
        table.add_row(
            w["name"], "+".join(w.get("roles", [])), f"{w.get('rank', '-')}/{w.get('world', '-')}",
            str(w.get("pid", "-")), str(w.get("weights_version", "-")),
            f"{w['rss_gb']:.2f}" if "rss_gb" in w else "-",
            f"{w['peak_rss_gb']:.2f}" if "peak_rss_gb" in w else "-",
            "ok" if healthy else f"[red]{w.get('error') or 'unhealthy'}[/]",
        )  # fmt: skip
    console.print(table)


@pool_app.command("down")
def pool_down(pool: PoolName = "default") -> None:
    """Kill the pool's workers; stop the local Ray head if no other pool uses it."""
    from hybrid_engine.pool import down

    pool = _checked_pool(pool)
    if not _connect():
        console.print("no Ray cluster is running: nothing to stop")
        return
    killed = down(pool)
    console.print(f"pool {pool!r}: stopped {len(killed)} worker(s) {killed}")


runs_app = typer.Typer(help="Training runs as MLflow tracked them.")
app.add_typer(runs_app, name="runs")
TrackingUri = Annotated[
    str | None,
    typer.Option("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db"),
]
Experiment = Annotated[str, typer.Option("--experiment", help="MLflow experiment")]


def _fail(e: Exception) -> None:
    """One red line naming the problem, exit status 1."""
    console.print(f"[red]error:[/] {e}", soft_wrap=True)
    raise typer.Exit(1) from None


@runs_app.command("list")
def runs_list(tracking_uri: TrackingUri = None, experiment: Experiment = "hybridrl") -> None:
    """Every run: id, status, steps, last score and validation accuracy, start time."""
    import datetime

    from rich.table import Table

    from storage.tracking import TrackingUnavailable, list_runs

    try:
        runs = list_runs(tracking_uri, experiment)
    except TrackingUnavailable as e:
        _fail(e)
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
            r.data.tags.get("hybridrl.run_id", r.info.run_name), r.info.status,
            r.data.params.get("trainer.total_training_steps", "-"),
            f"{m['critic/score/mean']:.3f}" if "critic/score/mean" in m else "-",
            f"{m['val/accuracy']:.3f}" if "val/accuracy" in m else "-",
            started.strftime("%Y-%m-%d %H:%M"), r.info.run_id,
        )  # fmt: skip
    console.print(table)


@runs_app.command("show")
def runs_show(run_id: str, tracking_uri: TrackingUri = None,
              experiment: Experiment = "hybridrl") -> None:  # fmt: skip
    """One run: tags (storage, checkpoint, Prefect flow run) and its last metrics."""
    from storage.tracking import TrackingUnavailable, find_run

    try:
        run = find_run(tracking_uri, run_id, experiment)
    except (LookupError, TrackingUnavailable) as e:
        _fail(e)
    console.print(f"[bold]{run_id}[/]  {run.info.status}  mlflow run {run.info.run_id}")
    for k, v in sorted(run.data.tags.items()):
        if k.startswith(("hybridrl.", "prefect.")):
            console.print(f"  {k:<24} {v}")
    for k, v in sorted(run.data.metrics.items()):
        console.print(f"  {k:<40} {v:.4g}")


@runs_app.command("compare")
def runs_compare(run_a: str, run_b: str, tracking_uri: TrackingUri = None,
                 experiment: Experiment = "hybridrl") -> None:  # fmt: skip
    """Two runs side by side: the config keys that differ, then their last metrics."""
    from rich.table import Table

    from storage.tracking import TrackingUnavailable, compare, find_run, ui_hint

    try:
        a, b = (find_run(tracking_uri, r, experiment) for r in (run_a, run_b))
    except (LookupError, TrackingUnavailable) as e:
        _fail(e)
    params, metrics = compare(a, b)
    for title, rows in (("config differences", params), ("last metrics", metrics)):
        table = Table(title=title)
        for col in ("key", run_a, run_b):
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    hint = ui_hint(tracking_uri, [a.info.run_id, b.info.run_id], a.info.experiment_id)
    console.print(f"MLflow UI: {hint}", soft_wrap=True)


@app.command()
def deploy(
    names: Annotated[
        list[str] | None, typer.Argument(help="deployments to make (default: all in the file)")
    ] = None,
    prefect_file: Annotated[
        str | None, typer.Option(help="default: deployments/prefect.yaml of this checkout")
    ] = None,
) -> None:
    """Deploy the scheduled trainings of deployments/prefect.yaml to the Prefect server.

    The server is the one $PREFECT_API_URL names (`prefect server start --host 127.0.0.1`).
    Each deployment's config is checked first; the process work pool it names is created if
    missing; then `prefect deploy` runs with HYBRIDRL_HOME set to this checkout, where the
    worker will run the flow. Prints how to start a worker and a run."""
    from pathlib import Path

    from flows.deploy import DEFAULT_FILE, DeployError
    from flows.deploy import deploy as make

    try:
        got = make(names or [], Path(prefect_file) if prefect_file else DEFAULT_FILE)
    except DeployError as e:
        _fail(e)
    for pool in got["pools_created"]:
        console.print(f"work pool {pool!r} created (type process)")
    for d in got["deployments"]:
        when = ", ".join(f"cron {c}" for c in d["schedules"]) or "no schedule"
        console.print(f"deployed [bold]{d['name']}[/] on pool {d['pool']!r}: {when}")
    pool = got["deployments"][0]["pool"]
    console.print(
        f"flow runs execute in {got['home']}. Next:\n"
        f"  prefect worker start --pool {pool} --type process   # runs the schedules\n"
        f"  prefect deployment run '{got['deployments'][0]['name']}' "
        f"--param 'overrides=[\"trainer.total_training_steps=2\"]' --watch",
        soft_wrap=True,
        highlight=False,
    )


@app.command()
def version() -> None:
    """Print the hybridrl version."""
    from importlib.metadata import version as v

    console.print(v("hybridrl"))


if __name__ == "__main__":
    app()
