"""`hybridrl`: the command line.

    hybridrl train CONFIG [key.path=value ...]
    hybridrl pool status [--pool NAME]     the persistent workers: version, role, rank, RSS
    hybridrl pool down [--pool NAME]       stop them (and the local Ray head if it is idle)

Prints the run id, shows per-step progress, saves the final policy to
`<trainer.output_dir>/<run_id>/final/`, and exits 0; on failure it exits 1 with one line
naming the problem (`--debug` shows the traceback).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

app = typer.Typer(add_completion=False, help="hybridrl: RL post-training for language models.")
console = Console()

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def make_run_id(config_path: str, given: str | None) -> str:
    run_id = given or f"{Path(config_path).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not RUN_ID.match(run_id) or ".." in run_id:
        raise ValueError(
            f"trainer.run_id={run_id!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return run_id


def _fmt(m: dict[str, float], key: str, spec: str = ".3f") -> str:
    return format(m[key], spec) if key in m else "-"


@app.command()
def train(
    config: Annotated[str, typer.Argument(help="YAML preset, e.g. configs/demo_cpu.yaml")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="dotted overrides: actor.optim.lr=1e-6")
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    """Train a policy with RL (in-process loop)."""
    try:
        from hybrid_engine.config import load_config
        from hybrid_engine.trainer import Engine
        from hybrid_engine.trainer import train as train_loop
        from storage.final import save_final

        cfg = load_config(config, overrides or [])
        run_id = make_run_id(config, cfg.trainer.run_id)
        cfg.trainer.run_id = run_id
        console.print(f"run id: [bold]{run_id}[/]")
        console.print(
            f"{cfg.algorithm.adv_estimator} on {cfg.model.path}, {cfg.data.train_source}: "
            f"{cfg.trainer.total_training_steps} steps x {cfg.data.train_batch_size} prompts "
            f"x {cfg.rollout.n} samples"
        )
        where = "the Ray worker pool" if cfg.trainer.backend == "ray" else "this process"
        with console.status(f"loading model and data ({where})"):
            engine = Engine(cfg)
        console.print(
            f"validation: {len(engine.data.val)} held-out questions "
            f"({engine.data.val_dropped} dropped for also being in training)"
        )
        progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console,
        )  # fmt: skip
        task = progress.add_task("steps", total=cfg.trainer.total_training_steps, info="")

        def on_step(step: int, m: dict[str, float]) -> None:
            if step == 0:
                console.print(f"val/accuracy before training: {m.get('val/accuracy', 0):.3f}")
                return
            progress.console.print(
                f"step {step:>4}  score {_fmt(m, 'critic/score/mean')}  "
                f"val_acc {_fmt(m, 'val/accuracy')}  pg_loss {_fmt(m, 'actor/pg_loss', '+.4f')}  "
                f"entropy {_fmt(m, 'actor/entropy')}  len {_fmt(m, 'response_length/mean', '.1f')}  "
                f"gen {_fmt(m, 'perf/tokens_per_s_rollout', '.0f')} tok/s  "
                f"{_fmt(m, 'timing_s/step', '.1f')} s"
            )
            progress.update(task, advance=1, info=f"score {m.get('critic/score/mean', 0):.2f}")

        start = time.perf_counter()
        with progress:
            _, history = train_loop(cfg, on_step=on_step, engine=engine)
        minutes = (time.perf_counter() - start) / 60
        final = save_final(
            Path(cfg.trainer.output_dir) / run_id, engine.policy(), engine.tokenizer, cfg,
            history,
        )  # fmt: skip
        before = history[0].get("val/accuracy") if history[0]["step"] == 0 else None
        after = history[-1].get("val/accuracy")
        if before is not None and after is not None:
            console.print(
                f"held-out greedy accuracy: {before:.3f} -> {after:.3f} "
                f"({(after - before) * 100:+.1f} points)"
            )
        console.print(
            f"trained {cfg.trainer.total_training_steps} steps in {minutes:.1f} min; "
            f"final policy: {final}"
        )
        if engine.pool is not None:
            console.print(
                f"worker pool {cfg.ray.pool_name!r} stays up for the next run "
                f"(`hybridrl pool status`, `hybridrl pool down --pool {cfg.ray.pool_name}`)"
            )
    except (KeyboardInterrupt, typer.Exit):
        raise
    except Exception as e:
        if debug:
            raise
        console.print(f"[red]error:[/] {type(e).__name__}: {e}", soft_wrap=True)
        raise typer.Exit(1) from None


pool_app = typer.Typer(help="The persistent Ray worker pool.")
app.add_typer(pool_app, name="pool")
PoolName = Annotated[str, typer.Option("--pool", help="ray.pool_name of the pool")]


def _connect() -> bool:
    from hybrid_engine.config import load_config
    from hybrid_engine.pool import connect

    return connect(load_config(None, []), start=False) is not None


@pool_app.command("status")
def pool_status(pool: PoolName = "default") -> None:
    """Each worker: weights version, role, rank, pid, RSS, health."""
    from rich.table import Table

    from hybrid_engine.pool import pool_status as status

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

    if not _connect():
        console.print("no Ray cluster is running: nothing to stop")
        return
    killed = down(pool)
    console.print(f"pool {pool!r}: stopped {len(killed)} worker(s) {killed}")


@app.command()
def version() -> None:
    """Print the hybridrl version."""
    from importlib.metadata import version as v

    console.print(v("hybridrl"))


if __name__ == "__main__":
    app()
