"""The options every command spells the same way: where runs live and where they are tracked.

    --storage-root URL   storage.root: a directory or s3://bucket/prefix
                         (default: $HYBRIDRL_STORAGE__ROOT, else ./runs)
    --tracking-uri URI   tracking.uri: MLflow's tracking server or sqlite:///path
                         (default: $HYBRIDRL_TRACKING__URI, $MLFLOW_TRACKING_URI, else
                         sqlite:///mlflow.db in the working directory)

The older spelling, `storage.root=...` / `tracking.uri=...` among the overrides of `train`,
`resume` and `fork`, still works; a run that finishes prints one line saying so (a command
that fails prints only its error).
"""

from __future__ import annotations

from typing import Annotated

import typer

StorageRoot = Annotated[
    str | None,
    typer.Option(
        "--storage-root",
        help="where runs live: a directory or s3://bucket/prefix "
        "(default: $HYBRIDRL_STORAGE__ROOT, else ./runs)",
    ),
]
TrackingUri = Annotated[
    str | None,
    typer.Option(
        "--tracking-uri",
        help="MLflow: a tracking server or sqlite:///path (default: $HYBRIDRL_TRACKING__URI, "
        "$MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
    ),
]
OLD = {"storage.root": "--storage-root", "tracking.uri": "--tracking-uri"}


def as_overrides(storage_root: str | None, tracking_uri: str | None) -> list[str]:
    """The two options as the config overrides they stand for."""
    out = [f"storage.root={storage_root}"] if storage_root else []
    return out + ([f"tracking.uri={tracking_uri}"] if tracking_uri else [])


def with_options(
    overrides: list[str] | None, storage_root: str | None, tracking_uri: str | None
) -> list[str]:
    """The overrides plus the options (the options win)."""
    return list(overrides or []) + as_overrides(storage_root, tracking_uri)


def old_spellings(overrides: list[str]) -> list[str]:
    """One deprecation line per old spelling among the overrides."""
    keys = [item.partition("=")[0].strip() for item in overrides]
    return [
        f"note: `{k}=...` as an override is the old spelling; `{OLD[k]} ...` is the same "
        "and works with every command"
        for k in OLD
        if k in keys
    ]
