"""MLflow tracking on a real sqlite store: one MLflow run per training run, continued (not
duplicated) by a resume, each step's metrics logged once, params and tags as promised."""

import json
import math
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from hybrid_engine.config import load_config
from storage.store import RunStore
from storage.tracking.tracker import Tracker


@pytest.fixture
def setup(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(
        "configs/grpo_tiny.yaml",
        [f"storage.root={tmp_path}/runs", f"tracking.uri={uri}", "tracking.experiment=t"],
    )
    store = RunStore(cfg.storage, "run-a")
    store.write_run({"run_id": "run-a"})
    return cfg, store, MlflowClient(uri)


def test_one_mlflow_run_continued_by_resume_and_steps_logged_once(setup, tmp_path):
    cfg, store, client = setup
    first = Tracker.open(cfg, store, "flow-1", "0.1.0+abc")
    assert first.logged_steps() == set()
    first.log_step(0, {"val/accuracy": 0.25})
    first.log_step(
        1,
        {"timing_s/step": 1.5, "critic/score/mean": 0.5, "bad": math.nan, "flag": True, "step": 1},
    )
    # the driver dies; the resumed flow opens the same MLflow run through run.json
    again = Tracker.open(cfg, store, "flow-2", "0.1.0+abc")
    assert again.run_id == first.run_id == store.read_run()["mlflow_run_id"]
    assert again.logged_steps() == {0, 1}
    again.log_step(2, {"timing_s/step": 1.4})
    again.log_samples(2, [{"prompt": "1+1?", "response": "2", "score": 1.0}])
    again.log_timeline(
        2,
        [("rollout", 1.0), ("reward", 0.1), ("advantage", 0.2), ("update", 2.0)],
        {"timing_s/gen": 0.9, "timing_s/update_actor": 1.8},
    )
    again.log_curves(
        [
            {"step": 0, "val/accuracy": 0.2},
            {"step": 1, "critic/score/mean": 0.5},
            {"step": 2, "critic/score/mean": 0.6, "val/accuracy": 0.3},
        ]
    )
    again.finish("FINISHED")

    runs = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "timing_s/step")] == [1, 2]
    assert set(run.data.metrics) == {"val/accuracy", "timing_s/step", "critic/score/mean"}
    tags = run.data.tags
    assert tags["hybridrl.run_id"] == "run-a" and tags["prefect.flow_run_id"] == "flow-2"
    assert tags["hybridrl.storage_uri"] == store.url and tags["hybridrl.code_version"]
    assert run.data.params["actor.optim.lr"] == "0.001"
    assert run.data.params["tracking.experiment"] == "t"
    paths = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert paths == ["config.yaml", "curves.png", "generations", "timeline"]
    for png in ("curves.png", "timeline/step_000002.png"):
        local = client.download_artifacts(run.info.run_id, png, tmp_path)
        assert Path(local).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path = client.download_artifacts(run.info.run_id, "generations/step_000002.json", tmp_path)
    table = json.loads(Path(path).read_text())
    assert table["columns"] == ["prompt", "response", "score"]
    assert table["data"] == [["1+1?", "2", 1.0]]


def test_runs_list_show_compare(tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    for run_id, lr, score in (("run-a", "1e-3", 0.25), ("run-b", "1e-4", 0.5)):
        cfg = load_config(
            "configs/grpo_tiny.yaml",
            [f"storage.root={tmp_path}/runs", f"tracking.uri={uri}", f"actor.optim.lr={lr}"],
        )
        store = RunStore(cfg.storage, run_id)
        store.write_run({"run_id": run_id})
        tracker = Tracker.open(cfg, store, None, "0.1.0")
        tracker.log_step(1, {"critic/score/mean": score, "timing_s/step": 1.0})
        tracker.finish("FINISHED")
    cli = CliRunner()
    out = cli.invoke(app, ["runs", "list", "--tracking-uri", uri], terminal_width=200)
    assert out.exit_code == 0 and "run-a" in out.output and "run-b" in out.output
    out = cli.invoke(
        app, ["runs", "compare", "run-a", "run-b", "--tracking-uri", uri], terminal_width=200
    )
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert any("actor.optim.lr" in ln and "0.001" in ln and "0.0001" in ln for ln in lines)
    assert any("critic/score/mean" in ln and "0.25" in ln and "0.5" in ln for ln in lines)
    assert f"mlflow ui --backend-store-uri {uri}" in out.output
    out = cli.invoke(app, ["runs", "show", "nope", "--tracking-uri", uri])
    assert out.exit_code == 1 and "no run 'nope'" in out.output


def test_multi_turn_generations_show_as_conversations(setup, tmp_path):
    from hybrid_engine.engine import Engine

    cfg, store, client = setup
    engine = Engine(load_config("configs/multiturn_tiny.yaml"))
    samples = engine.validate(2)["_samples"]
    tracker = Tracker.open(cfg, store, "flow-1", "0.1.0+abc")
    tracker.log_samples(0, samples)
    path = client.download_artifacts(tracker.run_id, "generations/step_000000.json", tmp_path)
    table = json.loads(Path(path).read_text())
    response = table["data"][0][1]
    assert response.count("[assistant]\n") == 3 and response.count("[user]\n") == 2
    assert "too high" in response or "too low" in response or "no number" in response


# a value for each kind of secret-looking name, and where the test puts it
SECRETS = {
    "Authorization": "Bearer auth-SECRET-1",
    "GITHUB_PAT": "pat-SECRET-2",
    "private-key": "pkey-SECRET-3",
    "private_key": "pkey-SECRET-4",
    "X-Api-Key": "xkey-SECRET-5",
    "DATABASE_URL": "postgres://u:db-SECRET-6@db.example/app",
}
MLFLOW_PASSWORD = "mlflow-SECRET-7"


def test_a_recorded_run_holds_no_secret_in_any_file_or_event(tmp_path, prefect_api, monkeypatch):
    """A run (tiny preset, 1 step, in-process) with each secret-looking name in
    `ray.worker_env` and an MLflow server reached through MLFLOW_TRACKING_URI with a password
    in it: no file of the run's storage, of the MLflow store (its sqlite file and its
    artifacts) nor the `hybridrl.run.finished` event holds any of the secret values."""
    import urllib.request

    from prefect.settings import PREFECT_API_URL, temporary_settings
    from servers import start_mlflow, stop

    from flows.train import train

    home = tmp_path / "mlflow"
    home.mkdir()
    proc, url = start_mlflow(home)
    try:
        with_password = url.replace("http://", f"http://hybridrl:{MLFLOW_PASSWORD}@")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", with_password)
        monkeypatch.setenv("HYBRIDRL_RAY__WORKER_ENV", json.dumps(SECRETS))  # as the CLI does
        overrides = [f"storage.root={tmp_path}/runs", "trainer.total_training_steps=1"]
        with temporary_settings({PREFECT_API_URL: prefect_api}):
            out = train(config="configs/grpo_tiny.yaml", overrides=overrides, run_id="sec1")
    finally:
        stop(proc)
    assert out["run_id"] == "sec1" and out["mlflow_run_id"]
    values = [*SECRETS.values(), MLFLOW_PASSWORD]
    files = [p for d in (tmp_path / "runs", home) for p in d.rglob("*") if p.is_file()]
    assert any(p.suffix == ".db" for p in files) and any("artifacts" in p.parts for p in files)
    assert any(p.name == "run.json" for p in files) and any(p.name == "COMMITTED" for p in files)
    leaks = [(str(p), v) for p in files for v in values if v.encode() in p.read_bytes()]
    assert leaks == []
    doc = json.loads((tmp_path / "runs" / "sec1" / "run.json").read_text())
    assert "<redacted>" in json.dumps(doc["config"]["ray"]["worker_env"])
    body = json.dumps(
        {
            "filter": {
                "event": {"name": ["hybridrl.run.finished"]},
                "resource": {"id": ["hybridrl.run.sec1"]},
            }
        }
    ).encode()
    req = urllib.request.Request(
        f"{prefect_api}/events/filter", data=body, headers={"Content-Type": "application/json"}
    )
    for _ in range(100):  # the event reaches the server shortly after the flow returns
        if events := json.loads(urllib.request.urlopen(req).read())["events"]:
            break
        time.sleep(0.2)
    (event,) = events
    assert event["payload"]["tracking_uri"] and MLFLOW_PASSWORD not in json.dumps(event)
