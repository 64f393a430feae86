"""MLflow tracking: one MLflow run per training run.

    tracker = Tracker.open(cfg, store, flow_run_id)   # creates the run, or continues it
    tracker.log_step(step, metrics)                    # once per step, never twice
    tracker.finish("FINISHED")

The MLflow run id is kept in the run's `run.json`, so `hybridrl resume` continues the same
MLflow run. Which steps MLflow already holds is read back from MLflow itself (the history of
one metric every step logs), so a step is logged exactly once even if the driver died between
committing a step and logging it. Params are the flattened config (it holds no secrets: those
come from the environment); tags name the run id, storage, Prefect flow run, code version and
pool.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import urllib.parse
from typing import Any

import yaml

from hybrid_engine.config import REDACTED, HybridConfig, flatten, redact
from storage.store import RunStore

log = logging.getLogger("hybridrl.tracking")

STEP_KEY = "timing_s/step"  # logged by every training step: its history says what is logged
VAL_KEY = "val/accuracy"  # logged by every validation (step 0 has no training metrics)


def tracking_uri(cfg: HybridConfig) -> str:
    """`tracking.uri`, else $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db."""
    if cfg.tracking.uri:
        return cfg.tracking.uri
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"


def usable_uri(uri: str | None) -> str:
    """A tracking URI as recorded (run.json, the `hybridrl.run.finished` event: its password
    "<redacted>") made usable again: $MLFLOW_TRACKING_URI when it is that URI with its
    password; None gives `tracking_uri`'s default."""
    current = tracking_uri(HybridConfig())
    if uri is None or REDACTED not in uri:
        return uri or current
    if redact(current) == uri:
        return current
    raise TrackingUnavailable(
        f"the tracking URI {uri} was recorded without its password: set MLFLOW_TRACKING_URI "
        "to it with the password"
    )


class TrackingUnavailable(RuntimeError):
    """The tracking store is not there: a server that does not answer, a missing database."""


def check_tracking(uri: str, must_exist: bool = False, timeout_s: float = 5.0) -> None:
    """Fail in seconds, with one line, where MLflow would retry for minutes or create a store:
    an http(s) server must answer within `timeout_s`; with `must_exist` (commands that only
    read) a sqlite file or a local directory must exist already."""
    import urllib.error
    import urllib.request

    if uri.startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(uri)  # /health needs no login: without user:password@
        health = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        try:
            urllib.request.urlopen(f"{health.rstrip('/')}/health", timeout=timeout_s).close()
        except urllib.error.HTTPError:
            return  # it answered
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise TrackingUnavailable(
                f"the MLflow tracking server at {redact(uri)} does not answer ({reason}); start it or "
                "set tracking.uri / --tracking-uri"
            ) from None
    elif must_exist and (uri.startswith(("sqlite:///", "file://")) or "://" not in uri):
        path = uri.removeprefix("sqlite:///").removeprefix("file://")
        if not os.path.exists(path):
            raise TrackingUnavailable(f"no MLflow store at {uri} ({path} does not exist)")


def mark_driver_lost(cfg: HybridConfig, store: RunStore, why: str) -> str | None:
    """The MLflow run of a driver that died, marked FAILED with tag `hybridrl.driver_lost`
    (the next driver reopens it when it goes on). Its id, or None (no tracking, no MLflow run
    yet, or the tracking store did not answer: logged, not raised)."""
    run_id = (store.read_run() or {}).get("mlflow_run_id")
    if not cfg.tracking.enabled or run_id is None:
        return None
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri(cfg))
        if client.get_run(run_id).info.status != "RUNNING":
            return run_id
        client.set_tag(run_id, "hybridrl.driver_lost", why)
        client.set_terminated(run_id, status="FAILED")
    except Exception as e:  # noqa: BLE001 - the run goes on; StepLog reopens or warns
        log.warning("MLflow run %s of %s not marked FAILED: %s", run_id, store.run_id, e)
        return None
    return run_id


class Tracker:
    """The MLflow run of one training run."""

    def __init__(self, client: Any, run_id: str, uri: str) -> None:
        self.client, self.run_id, self.uri = client, run_id, uri

    @classmethod
    def open(
        cls, cfg: HybridConfig, store: RunStore, flow_run_id: str | None, code_version: str
    ) -> Tracker:
        from mlflow.tracking import MlflowClient

        uri = tracking_uri(cfg)
        check_tracking(uri)
        client = MlflowClient(uri)
        run_doc = store.read_run() or {}
        run_id = run_doc.get("mlflow_run_id")
        if run_id is not None:
            try:
                client.get_run(run_id)
                client.update_run(run_id, status="RUNNING")
            except Exception as e:  # another tracking server, or the run was deleted
                log.warning(
                    "MLflow run %s of %s not found at %s (%s): starting a new one",
                    run_id,
                    store.run_id,
                    redact(uri),
                    type(e).__name__,
                )
                run_id = None
        if run_id is None:
            run_id = cls._create(client, cfg, uri, store)
            where = {"mlflow_run_id": run_id, "mlflow_tracking_uri": redact(uri)}
            store.write_run({**run_doc, **where})
        tags = {"hybridrl.code_version": code_version}
        if lineage := run_doc.get("lineage"):  # a fork: the UI nests it under its parent
            tags |= {"hybridrl.parent": lineage["parent"], "hybridrl.fork_at": lineage["at"]}
            if lineage.get("parent_mlflow_run_id"):
                tags["mlflow.parentRunId"] = lineage["parent_mlflow_run_id"]
        if flow_run_id:
            tags["prefect.flow_run_id"] = flow_run_id
        if cfg.trainer.backend == "ray":
            tags["hybridrl.pool_name"] = cfg.ray.pool_name
        tracker = cls(client, run_id, uri)
        tracker.set_tags(tags)
        return tracker

    @staticmethod
    def _create(client: Any, cfg: HybridConfig, uri: str, store: RunStore) -> str:
        from mlflow.entities import Param

        exp = client.get_experiment_by_name(cfg.tracking.experiment)
        if exp is None:
            location = None
            if uri.startswith("sqlite:///"):  # artifacts beside the database, not in the cwd
                db = uri.removeprefix("sqlite:///")
                location = "file://" + os.path.join(
                    os.path.dirname(os.path.abspath(db)), "mlartifacts"
                )
            exp_id = client.create_experiment(cfg.tracking.experiment, artifact_location=location)
        else:
            exp_id = exp.experiment_id
        run = client.create_run(
            exp_id,
            run_name=store.run_id,
            tags={
                "hybridrl.run_id": store.run_id,
                "hybridrl.storage_uri": store.url,
            },
        )
        run_id = run.info.run_id
        params = [Param(k, str(redact(v))[:6000]) for k, v in sorted(flatten(cfg).items())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run_id, params=params[i : i + 100])
        client.log_text(
            run_id,
            yaml.safe_dump(redact(cfg.model_dump(mode="json")), sort_keys=False),
            "config.yaml",
        )
        return run_id

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def logged_steps(self) -> set[int]:
        """Steps whose metrics MLflow already holds."""
        steps = set()
        for key in (STEP_KEY, VAL_KEY):
            steps |= {m.step for m in self.client.get_metric_history(self.run_id, key)}
        return steps

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        """All of a step's metrics in one batch (MLflow takes up to 1000 per call)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [
            Metric(k, float(v), now, step)
            for k, v in sorted(metrics.items())
            if isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
            and k != "step"
        ]
        for i in range(0, len(rows), 1000):
            self.client.log_batch(self.run_id, metrics=rows[i : i + 1000])

    def log_metric(self, key: str, value: float, step: int) -> None:
        self.client.log_metric(self.run_id, key, float(value), step=step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """A validation's generations as an MLflow table (one JSON artifact per step)."""
        if samples:
            table = {k: [s[k] for s in samples] for k in ("prompt", "response", "score")}
            self.client.log_table(self.run_id, table, f"generations/step_{step:06d}.json")

    def log_timeline(self, step: int, walls: list[tuple[str, float]], metrics: dict) -> None:
        """The step's stage timeline as a PNG: where its seconds went."""
        fig = timeline_figure(step, walls, metrics)
        self.client.log_figure(self.run_id, fig, f"timeline/step_{step:06d}.png")
        _close(fig)

    def log_curves(self, rows: list[dict[str, Any]]) -> None:
        """Score and validation accuracy by step, redrawn as the run goes (`curves.png`)."""
        fig = curves_figure(rows)
        self.client.log_figure(self.run_id, fig, "curves.png")
        _close(fig)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


# ------------------------------------------------------------------------------ figures
# the engine's sub-timings (`timing_s/<name>`) inside each stage, in the order they run
SUB_TIMINGS = {
    "rollout": ["reshard", "gen", "gen_baseline"],
    "reward": ["reward"],
    "advantage": ["old_log_prob", "ref", "values", "adv"],
    "update": ["update_critic", "update_actor"],
}


def timeline_figure(step: int, walls: list[tuple[str, float]], metrics: dict) -> Any:
    """A Gantt chart: one row per stage (its wall time, storage and Prefect included), the
    engine's own timings as thinner bars inside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.6))
    start = 0.0
    for row, (stage, wall) in enumerate(walls):
        ax.barh(row, wall, left=start, height=0.7, color="#c8d6e5", edgecolor="#576574")
        ax.text(start + wall, row, f" {wall:.2f} s", va="center", fontsize=8)
        sub_start = start
        for name in SUB_TIMINGS.get(stage, []):
            sec = metrics.get(f"timing_s/{name}")
            if sec:
                ax.barh(row, sec, left=sub_start, height=0.35, color="#ee5253")
                if sec > 0.08 * max(w for _, w in walls):
                    ax.text(
                        sub_start + sec / 2,
                        row,
                        name,
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
                sub_start += sec
        start += wall
    ax.set_yticks(range(len(walls)), [s for s, _ in walls])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the step started")
    ax.set_title(f"step {step}: stages (wall) and engine timings (red)", fontsize=9)
    fig.tight_layout()
    return fig


def curves_figure(rows: list[dict[str, Any]]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for key, style in (("critic/score/mean", "-"), ("val/accuracy", "o-")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=key, markersize=4)
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _close(fig: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


# ------------------------------------------------------------------- reading runs back
def client_for(uri: str | None) -> Any:
    """A client for reading runs: the store must exist (reading never creates one)."""
    from mlflow.tracking import MlflowClient

    uri = usable_uri(uri)
    check_tracking(uri, must_exist=True)
    return MlflowClient(uri)


def list_runs(uri: str | None, experiment: str = "hybridrl") -> list[Any]:
    """The experiment's MLflow runs, newest first (empty if there is no such experiment)."""
    client = client_for(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return list(client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"]))


def find_run(uri: str | None, run_id: str, experiment: str = "hybridrl") -> Any:
    """The MLflow run of hybridrl run `run_id` (or of an MLflow run id)."""
    for run in list_runs(uri, experiment):
        if run.data.tags.get("hybridrl.run_id") == run_id or run.info.run_id == run_id:
            return run
    raise LookupError(
        f"no run {run_id!r} in MLflow experiment {experiment!r} at "
        f"{redact(uri or tracking_uri(HybridConfig()))}"
    )


def compare(a: Any, b: Any) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(config keys whose values differ, final metrics of both): rows (key, a, b)."""
    pa, pb = a.data.params, b.data.params
    params = [
        (k, pa.get(k, "-"), pb.get(k, "-"))
        for k in sorted(pa.keys() | pb.keys())
        if pa.get(k) != pb.get(k) and k != "trainer.run_id"
    ]
    ma, mb = a.data.metrics, b.data.metrics
    shown = [
        k
        for k in sorted(ma.keys() | mb.keys())
        if not k.startswith(("perf/", "timing_s/")) or k in ("timing_s/step", "perf/peak_rss_gb")
    ]
    metrics = [(k, _fmt(ma.get(k)), _fmt(mb.get(k))) for k in shown]
    return params, metrics


def fork_point(a: Any, b: Any) -> tuple[int, str] | None:
    """(the fork step, "a" or "b" the fork) when one run is the other's fork."""
    for fork, parent, which in ((a, b, "a"), (b, a, "b")):
        tags = fork.data.tags
        if tags.get("hybridrl.parent") == parent.data.tags.get("hybridrl.run_id") and (
            at := tags.get("hybridrl.fork_at")
        ):
            return int(at.split("/")[0]), which
    return None


CURVE_KEYS = ("critic/score/mean", "val/accuracy")


def curves_from(
    uri: str | None, a: Any, b: Any, first: int, keys: tuple[str, ...] = CURVE_KEYS
) -> list[tuple[str, ...]]:
    """Rows (step, a's and b's value of each key) for the steps from `first` on that either
    run logged: the two curves side by side."""
    client = client_for(uri)
    values: dict[int, dict[str, float]] = {}
    for i, run in enumerate((a, b)):
        for key in keys:
            for m in client.get_metric_history(run.info.run_id, key):
                if m.step >= first:
                    values.setdefault(m.step, {})[f"{i}:{key}"] = m.value
    return [
        (str(step), *(_fmt(values[step].get(f"{i}:{k}")) for k in keys for i in (0, 1)))
        for step in sorted(values)
    ]


def ui_hint(
    uri: str | None, run_ids: list[str], experiment_id: str, keys: tuple[str, ...] = CURVE_KEYS
) -> str:
    """Where to look at runs in the MLflow UI: its metric page with `keys` of every run
    overlaid by step (the compare-runs page opens on a parallel-coordinates plot)."""
    uri = redact(uri or tracking_uri(HybridConfig()))

    def q(value: object) -> str:
        return urllib.parse.quote(json.dumps(value, separators=(",", ":")))

    page = (
        f"#/metric?runs={q(run_ids)}&metric={q(keys[0])}&experiments={q([experiment_id])}"
        f"&plot_metric_keys={q(list(keys))}&x_axis=step&show_point=true"
    )
    if uri.startswith("http"):
        return f"{uri.rstrip('/')}/{page}"
    return f"`mlflow ui --backend-store-uri {uri} --port 5000`, then http://127.0.0.1:5000/{page}"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"
