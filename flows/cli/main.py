"""`hybridrl`: the command line.

    hybridrl train CONFIG [key.path=value ...]   a run as the Prefect `train` flow
    hybridrl resume RUN_ID [--storage-root URL]  continue a run where it stopped
    hybridrl fork RUN_ID --at STEP/STAGE [...]   a new run from another's stored stages
    hybridrl replay RUN_ID STEP/STAGE | --all    recompute stored stages, compare (audit)
    hybridrl evaluate NAME/VERSION | --run-id R  greedy acc, pass@k, maj@k; promotion gate
    hybridrl register RUN_ID [--step N]          a policy into MLflow's Model Registry
    hybridrl warmstart CONFIG --demos M:F        supervised warm-start on demonstrations
    hybridrl runs list|show RUN|compare A B      runs as MLflow tracked them
    hybridrl runs tree RUN | delete RUN          a run's forks; delete what no fork uses
    hybridrl pool status [--pool NAME]           the persistent workers: version, role, RSS
    hybridrl pool down [--pool NAME]             stop them (and the local Ray head if idle)
    hybridrl deploy [NAME ...]                   deployments/prefect.yaml to $PREFECT_API_URL

Every command takes `--storage-root` and `--tracking-uri` where it reads runs or MLflow
(`flows.cli.options`). `train` prints the run id and one line per step, and leaves the final policy in
`<storage.root>/<run_id>/final/`; on failure it exits 1 with one line naming the problem
(`--debug` shows the traceback).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Annotated

import psutil
import typer
from rich.text import Text

from flows.cli.options import (
    StorageRoot,
    TrackingUri,
    as_overrides,
    old_spellings,
    with_options,
)
from flows.cli.runs import console, runs_app
from flows.cli.runs import fail as _fail

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
app.add_typer(runs_app, name="runs")

Overrides = Annotated[
    list[str] | None, typer.Argument(help="dotted overrides: actor.optim.lr=1e-6")
]
Debug = Annotated[bool, typer.Option("--debug", help="show tracebacks")]


class _NoTraceback(logging.Filter):
    """Prefect logs a failed task's or flow's traceback; without --debug one line is enough."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def _run_flow(
    config: str | None,
    overrides: list[str],
    run_id: str | None,
    resume: bool,
    debug: bool,
    fork_from: str | None = None,
    notes: list[str] = (),
) -> None:
    try:
        from hybrid_engine.config import load_config

        if resume:  # the stored config with the overrides, checked as the flow will
            from flows.opening import resumed_config

            cfg = resumed_config(run_id, overrides)
        elif fork_from:  # the parent's config with the overrides a fork may change
            from flows.opening import open_run, run_exists

            if run_id and run_exists(overrides, run_id):  # the flow would resume it
                raise FileExistsError(f"run {run_id!r} already exists: `hybridrl resume {run_id}`")
            opened = open_run(None, overrides, run_id, fork_from=fork_from)
            cfg, run_id = opened.cfg, opened.store.run_id
        else:
            cfg = load_config(config, overrides)
        if not resume:  # bad input fails here, in a second, before Prefect starts
            from storage.store import new_run_id, validate_run_id

            run_id = validate_run_id(run_id or cfg.trainer.run_id or new_run_id(config))
            if cfg.tracking.enabled:  # a server that is down: seconds, not minutes
                from storage.tracking.tracker import check_tracking, tracking_uri

                check_tracking(tracking_uri(cfg))
            from flows.cli.preflight import preflight

            preflight(cfg)  # model dirs, data, reward function, storage root: seconds
            from flows.opening import refuse_existing
            from storage.store import RunStore

            refuse_existing(RunStore(cfg.storage, run_id))
            fork = f" (a fork of {fork_from})" if fork_from else ""
            console.print(Text.assemble("run id: ", (run_id, "bold"), fork))
        # before Prefect starts threads (see its docstring); only where the models live: a
        # pool's driver holds none, and keeping every block it frees only holds memory
        if cfg.trainer.reuse_freed_memory and cfg.trainer.backend == "local":
            from hybrid_engine.roles.workers import reuse_freed_memory

            reuse_freed_memory()
        from flows.train import train as train_flow

        if not debug:
            for handler in logging.getLogger().handlers:  # Prefect's console handler
                handler.addFilter(_NoTraceback())
        kwargs = {"overrides": secrets_to_environment(overrides)}
        if resume:
            kwargs["resume_from"] = run_id
        else:
            kwargs |= {"config": config, "run_id": run_id, "fork_from": fork_from}
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
            console.print(
                f"recovered from {result['recoveries']} worker fault(s) on the way "
                "(run.json: recoveries)"
            )
        if "val/accuracy" in rows:
            console.print(f"final val/accuracy: {rows['val/accuracy']:.3f}")
        from flows.display import held_out_line

        wall_s = time.time() - psutil.Process().create_time()  # the whole command
        console.print(held_out_line(result.get("validation", []), wall_s))
        console.print(f"final policy: {result['uri']}")
        for line in notes:  # the old spellings the command was given
            console.print(line, style="yellow", highlight=False)
        if result.get("registered"):
            console.print(
                f"registered as {result['registered']['model']} in MLflow's Model Registry"
            )
        if result.get("pool"):
            console.print(
                f"worker pool {result['pool']!r} stays up for the next run "
                f"(`hybridrl pool status`, `hybridrl pool down --pool {result['pool']}`)"
            )
    except (KeyboardInterrupt, typer.Exit):
        raise
    except Exception as e:
        # SIGTERM: the flow run ended in state "Preempted". No flow ran without Prefect
        # imported (a config error), and importing it just to check would cost a second.
        prefect = sys.modules.get("prefect.exceptions")
        if prefect and isinstance(e, prefect.CancelledRun):
            console.print(str(e), style="yellow", soft_wrap=True)
            raise typer.Exit(143) from None
        if debug:
            raise
        console.print(Text.assemble(("error:", "red"), f" {type(e).__name__}: {e}"), soft_wrap=True)
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
    run_id: Annotated[str | None, typer.Option(help="default: PRESET-TIMESTAMP")] = None,
    storage_root: StorageRoot = None,
    tracking_uri: TrackingUri = None,
    debug: Debug = False,
) -> None:
    """Train a policy with RL: the Prefect `train` flow, each stage checkpointed.

    CONFIG is a YAML preset (configs/); overrides are dotted `key.path=value` pairs (the
    docs' configuration reference lists every key). Prints the run id, live progress and a
    line per step; the final policy lands in `<storage root>/<run_id>/final/`."""
    given = with_options(overrides, storage_root, tracking_uri)
    _run_flow(config, given, run_id, False, debug, notes=old_spellings(overrides or []))


@app.command()
def resume(
    run_id: Annotated[str, typer.Argument(help="the run to continue")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="ray.*, more steps, ... (what a resume may change)"),
    ] = None,
    storage_root: StorageRoot = None,
    tracking_uri: TrackingUri = None,
    debug: Debug = False,
) -> None:
    """Continue a run where it stopped: committed stages are skipped, nothing regenerated.

    The run's stored config is used; overrides may change only where things live and run
    (`storage.*`, `ray.*`, `pipeline.*`, `tracking.*`, threads, backend, save/test
    frequency) or train longer (`trainer.total_training_steps`). Give `--storage-root`
    when the run is not under ./runs."""
    given = with_options(overrides, storage_root, tracking_uri)
    _run_flow(None, given, run_id, True, debug, notes=old_spellings(overrides or []))


@app.command()
def fork(
    run_id: Annotated[str, typer.Argument(help="the run to fork (the parent)")],
    at: Annotated[
        str,
        typer.Option(
            "--at", help="STEP/STAGE: the first stage the fork computes, e.g. 20/advantage"
        ),
    ],
    new_run_id: Annotated[
        str | None,
        typer.Option("--run-id", help="the fork's run id (default: <parent>-fork-<step>-<stage>)"),
    ] = None,
    overrides: Overrides = None,
    storage_root: StorageRoot = None,
    tracking_uri: TrackingUri = None,
    debug: Debug = False,
) -> None:
    """Fork a run at a stage: a new run whose steps before STEP, and the stages of STEP
    before STAGE, are the parent's committed stages (referenced by their sha256, not
    copied); from there on it computes with the overrides.

    The fork starts from the parent's weights at that point (its checkpoint before STEP plus
    the stored updates). What a fork may change depends on STAGE: at `advantage` it may
    change `algorithm.*` and `actor.*` but not `rollout.*` (its rollout is the parent's);
    the data, model and seed never. Refused keys are named with the reason."""
    given = with_options(overrides, storage_root, tracking_uri)
    notes = old_spellings(overrides or [])
    _run_flow(None, given, new_run_id, False, debug, fork_from=f"{run_id}@{at}", notes=notes)


@app.command()
def replay(
    run_id: Annotated[str, typer.Argument(help="the run to audit")],
    at: Annotated[
        str | None,
        typer.Argument(
            help="STEP/STAGE, e.g. 3/advantage (stages: rollout reward advantage update validate)"
        ),
    ] = None,
    all_stages: Annotated[bool, typer.Option("--all", help="every committed stage")] = False,
    storage_root: StorageRoot = None,
    debug: Debug = False,
) -> None:
    """Recompute committed stages from their stored inputs and the weights they saw, and
    compare with what is stored: bit-equal, or the first differing tensor (or metric) and
    its largest difference. Exit status 1 when a stage differs.

    One stage, or `--all` on a fresh engine in the order the weights were made. A pool run
    is replayed on a pool of its own (`<ray.pool_name>-audit`, stopped at the end)."""
    import time

    from rich.table import Table

    if (at is None) == (not all_stages):
        _fail(ValueError("give STEP/STAGE or --all"))
    engine = None
    try:
        from flows.opening import resumed_config
        from hybrid_engine.engine import Engine
        from storage.store import RunStore, check_reach
        from tasks.replay import STAGE_ORDER, Replayer, audit_run

        where = as_overrides(storage_root, None)
        cfg = resumed_config(run_id, where)
        if cfg.trainer.backend == "ray":
            cfg = resumed_config(run_id, [*where, f"ray.pool_name={cfg.ray.pool_name}-audit"])
        store = RunStore(cfg.storage, run_id)
        if at is not None:
            step, _, stage = at.partition("/")
            if not step.isdigit() or stage not in STAGE_ORDER:
                raise ValueError(f"{at!r}: write STEP/STAGE, STAGE one of {', '.join(STAGE_ORDER)}")
        began = time.perf_counter()
        engine = Engine(cfg)
        if engine.pool is not None:
            check_reach(cfg.storage, engine.pool.nodes())
        table = Table(title=f"replay of {run_id}")
        for col in ("stage", "result", "seconds"):
            table.add_column(col)
        audits = (
            audit_run(engine, store)
            if all_stages
            else iter([Replayer(engine, store).replay(int(step), stage)])
        )
        differ = 0
        for a in audits:
            mark = {
                True: Text("bit-equal", "green"),
                False: Text(a.detail, "red"),
                None: Text(a.detail),
            }
            console.print(
                Text.assemble(f"{a.step}/{a.stage}: ", mark[a.equal], f" ({a.seconds:.2f} s)"),
                highlight=False,
            )
            table.add_row(f"{a.step}/{a.stage}", mark[a.equal], f"{a.seconds:.2f}")
            differ += a.equal is False
        if all_stages:
            console.print(table)
        console.print(
            f"{'all equal' if not differ else f'{differ} stage(s) differ'} "
            f"({time.perf_counter() - began:.0f} s)"
        )
    except (KeyboardInterrupt, typer.Exit):
        raise
    except Exception as e:
        if debug:
            raise
        _fail(e)
    finally:
        if engine is not None and engine.pool is not None:
            engine.pool.down(stop_head=False, keep_claim=False)
    if differ:
        raise typer.Exit(1)


from flows.cli import models as cli_models  # noqa: E402 - the registry commands
from flows.cli.cluster import cluster_app, pool_app  # noqa: E402

app.add_typer(cluster_app, name="cluster")
app.add_typer(pool_app, name="pool")

app.command("evaluate")(cli_models.evaluate)
app.command("register")(cli_models.register)
app.command("warmstart")(cli_models.warmstart)


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
        console.print(
            Text.assemble("deployed ", (d["name"], "bold"), f" on pool {d['pool']!r}: {when}")
        )
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
