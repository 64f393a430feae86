"""`hybridrl evaluate` and `hybridrl register`: policies in the MLflow Model Registry."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.text import Text

from flows.cli.options import StorageRoot, TrackingUri, as_overrides
from flows.cli.runs import console, fail


def evaluate(
    model: Annotated[str | None, typer.Argument(help="NAME/VERSION or NAME@ALIAS")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="a run's policy instead")] = None,
    step: Annotated[int | None, typer.Option(help="with --run-id: checkpoint step_N")] = None,
    k: Annotated[int | None, typer.Option(help="samples per question (registry.eval_k)")] = None,
    promote: Annotated[bool, typer.Option(help="a version: run the promotion gate")] = True,
    storage_root: StorageRoot = None,
    tracking_uri: TrackingUri = None,
) -> None:
    """Evaluate a registered version (or a run's final policy / checkpoint) on its run's
    held-out questions: greedy accuracy, pass@k, maj@k, lengths, format. Logged to MLflow;
    a version then takes the alias `champion` if it beats the champion by
    registry.promotion_margin and passes the sanity checks, else it is tagged with why not."""
    from flows.evaluate import evaluate as evaluate_flow

    try:
        got = evaluate_flow(
            model=model,
            run_id=run_id,
            step=step,
            k=k,
            promote=promote,
            storage_root=storage_root,
            tracking_uri=tracking_uri,
        )
    except Exception as e:
        fail(e)
    console.print(got["evaluated"], style="bold")
    for key, value in got["metrics"].items():
        console.print(f"  {key:<28} {value:.3f}")
    if "why" in got:
        console.print(got["why"], style="green" if got["promoted"] else "yellow")


def register(
    run_id: Annotated[str, typer.Argument(help="the run")],
    step: Annotated[int | None, typer.Option(help="checkpoint step_N (default: final/)")] = None,
    storage_root: StorageRoot = None,
    tracking_uri: TrackingUri = None,
) -> None:
    """Register a run's final policy, or one of its checkpoints, as a version of
    registry.model_name in MLflow's Model Registry (with the run, step and metrics as tags)."""
    try:
        from flows.opening import resumed_config
        from storage.store import RunStore
        from tasks.publish import register_checkpoint, register_final

        cfg = resumed_config(run_id, as_overrides(storage_root, tracking_uri))
        store = RunStore(cfg.storage, run_id)
        if step is None:
            got = register_final.fn(cfg, store)
            if got is None:
                raise ValueError(
                    f"run {run_id}: tracking.enabled or registry.register_final is false"
                )
            name = got["model"]
        else:
            v = register_checkpoint(cfg, store, step)
            name = f"{v.name}/{v.version}"
    except Exception as e:
        fail(e)
    console.print(
        Text.assemble(
            "registered as ",
            (name, "bold"),
            f": load it with mlflow.transformers.load_model('models:/{name}')",
        )
    )


def warmstart(
    config: Annotated[str, typer.Argument(help="YAML preset: its model and training rows")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="dotted overrides: data.train_size=1000")
    ] = None,
    demos: Annotated[
        str, typer.Option(help="module:function(row) -> the conversation to imitate")
    ] = "hybrid_engine.rollout.agent.examples:calculator_demonstration",
    out: Annotated[str, typer.Option(help="new directory for the model")] = "warmstart",
    examples: Annotated[int, typer.Option(min=1, help="demonstrations (first rows)")] = 64,
    epochs: Annotated[int, typer.Option(min=1)] = 1,
    lr: Annotated[float, typer.Option(min=0.0)] = 1e-5,
    batch_size: Annotated[int, typer.Option(min=1)] = 8,
) -> None:
    """Supervised warm-start: fine-tune the preset's model on demonstrations of its training
    rows (the assistant's replies trained), saved as a model directory that a run starts
    from with `model.path=OUT`. For behaviours the policy never samples, which RL cannot
    reward (SmolLM2 calling a tool)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from hybrid_engine.config import load_config
    from hybrid_engine.warmstart import warm_start

    try:
        cfg = load_config(config, overrides or [])
        with Progress(
            TextColumn("warm-start"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            console=console,
        ) as bar:
            task = bar.add_task("", total=None)

            def shown(i: int, total: int, loss: float) -> None:
                bar.update(task, completed=i, total=total, description=f"loss {loss:.3f}")

            got = warm_start(cfg, demos, out, examples, epochs, lr, batch_size, on_step=shown)
    except Exception as e:
        fail(e)
    console.print(
        Text.assemble(
            f"{got['examples']} demonstrations, {got['trained_tokens']} trained tokens, "
            f"loss {got['losses'][0]:.3f} -> {got['losses'][-1]:.3f} in {got['seconds']:.0f} s; "
            "train from it with ",
            (f"model.path={out}", "bold"),
        )
    )
