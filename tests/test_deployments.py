"""The scheduled-training journey, for real: `deployments/prefect.yaml` deployed to a real
Prefect server, a process work pool and worker, `prefect deployment run ... --watch` of a
2-step tiny training, and the run found in a real MLflow server through its REST API; the
run's `hybridrl.run.finished` event runs the `evaluate-on-finish` deployment by itself (the
automation `hybridrl deploy` created), which makes the registered version `champion`. Then a
deployment run preempted (SIGTERM to its process) resumes itself: the deployment's trigger
on the "Preempted" state runs it again with resume_from = the run id; and one whose driver
is SIGKILLed (the flow run Crashed) by the trigger on "Crashed", its MLflow run finished."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent


def hybridrl(*args, env):
    return subprocess.run(
        [str(BIN / "hybridrl"), *args],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )


def test_deploy_refuses_what_cannot_work(tmp_path, prefect_api):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    p = hybridrl("deploy", env={**env, "PREFECT_HOME": str(tmp_path)})
    assert p.returncode == 1 and "PREFECT_API_URL is not set" in p.stdout, p.stdout + p.stderr
    bad = tmp_path / "prefect.yaml"
    doc = (ROOT / "deployments/prefect.yaml").read_text()
    bad.write_text(doc.replace('["trainer.total_training_steps=2"]', '["trainer.total_steps=2"]'))
    p = hybridrl("deploy", "--prefect-file", str(bad), env={**env, "PREFECT_API_URL": prefect_api})
    assert p.returncode == 1 and "Traceback" not in p.stdout + p.stderr
    assert (
        "deployment 'grpo-tiny-nightly': invalid config: unknown key 'trainer.total_steps'"
        in p.stdout
    )


def test_deployment_run_trains_and_lands_in_mlflow(tmp_path, prefect_api):
    from servers import start_mlflow, stop

    mlflow_proc, mlflow_url = start_mlflow(tmp_path)
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "HYBRIDRL_HOME": str(ROOT),
        "PYTHONPATH": str(ROOT / "tests"),
    }
    env.pop("HYBRIDRL_FAULT", None)

    def prefect(*args, timeout=300, check=True):
        p = subprocess.run(
            [str(BIN / "prefect"), *args],
            cwd=ROOT,
            env=env,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
        assert p.returncode == 0 or not check, p.stdout + p.stderr
        return p.stdout + p.stderr

    worker = None
    try:
        made = hybridrl("deploy", env=env)  # pool created, configs checked, prefect deploy
        assert made.returncode == 0, made.stdout + made.stderr
        assert "work pool 'hybridrl' created" in made.stdout
        assert "deployed train/grpo-tiny-nightly on pool 'hybridrl': cron 0 3 * * *" in made.stdout
        listed = prefect("deployment", "ls")
        assert "train/grpo-tiny-nightly" in listed and "train/demo-cpu-weekly" in listed
        assert "evaluate/evaluate-on-finish" in listed
        automations = prefect("automation", "ls")
        assert "evaluate-on-finish" in automations, automations
        # the resumed run gets the deployment's parameters: storage and tracking come from
        # the worker's environment, as on a real worker machine
        # the worker asks for scheduled runs every second (Prefect's default: every 10 s)
        worker_env = {
            **env,
            "HYBRIDRL_STORAGE__ROOT": f"{tmp_path}/runs",
            "HYBRIDRL_TRACKING__URI": mlflow_url,
            "PREFECT_WORKER_QUERY_SECONDS": "1",
        }
        worker = subprocess.Popen(
            [str(BIN / "prefect"), "worker", "start", "--pool", "hybridrl", "--type", "process"],
            cwd=tmp_path,
            env=worker_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        # another test's evaluation of a "hybridrl-policy/1" on this server is not this one
        earlier = frozenset(r["id"] for r in flow_runs(prefect_api, "eval-hybridrl-policy-1"))
        overrides = [
            "trainer.total_training_steps=2",
            f"storage.root={tmp_path}/runs",
            f"tracking.uri={mlflow_url}",
            "reward.function=reward_fns:length_score",
            "registry.min_format_rate=0",
            "registry.max_clip_ratio=1",
        ]

        def run_nightly(run_id: str, fault: str | None = None) -> str:
            """`prefect deployment run ... --watch` of the nightly deployment as `run_id`,
            with a fault point in that flow run's own environment."""
            env = ["--job-variable", f"env={json.dumps({'HYBRIDRL_FAULT': fault})}"]
            return prefect(
                "deployment",
                "run",
                "train/grpo-tiny-nightly",
                "--param",
                f"overrides={json.dumps(overrides)}",
                "--param",
                f"run_id={run_id}",
                *(env if fault else []),
                "--watch",
                timeout=600,
                check=fault is None,
            )

        out = run_nightly("scheduled-1")
        assert "Completed" in out, out
        assert (tmp_path / "runs/scheduled-1/final/COMMITTED").is_file()

        run = mlflow_run(mlflow_url, "scheduled-1")
        assert run["info"]["status"] == "FINISHED"
        metrics = {m["key"]: m for m in run["data"]["metrics"]}
        assert metrics["critic/score/mean"]["step"] == 2 and "actor/pg_loss" in metrics
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["prefect.flow_run_id"] and tags["hybridrl.final"].endswith("final")
        assert tags["hybridrl.model_version"] == "hybridrl-policy/1"

        # the finished run's event -> the automation -> the evaluate deployment's flow run
        states = wait_for_states(prefect_api, "eval-hybridrl-policy-1", "Completed", 600, earlier)
        assert "Completed" in states, states
        req = urllib.request.Request(
            f"{mlflow_url}/api/2.0/mlflow/registered-models/alias"
            "?name=hybridrl-policy&alias=champion"
        )
        version = json.loads(urllib.request.urlopen(req).read())["model_version"]
        assert version["version"] == "1"
        version_tags = {t["key"]: t["value"] for t in version["tags"]}
        assert version_tags["hybridrl.run_id"] == "scheduled-1"
        assert version_tags["hybridrl.promotion"].startswith("champion: accuracy")
        assert "eval.accuracy" in version_tags and "eval.maj_at_4" in version_tags
        body = json.dumps(
            {
                "filter": {
                    "event": {"prefix": ["hybridrl."]},
                    "resource": {"id": ["hybridrl.run.scheduled-1"]},
                },
                "limit": 50,
            }
        ).encode()
        req = urllib.request.Request(
            f"{prefect_api}/events/filter", data=body, headers={"Content-Type": "application/json"}
        )
        events = json.loads(urllib.request.urlopen(req).read())["events"]
        got = sorted(
            (e["event"], e["payload"].get("step") or e["payload"].get("model")) for e in events
        )
        assert got == [
            ("hybridrl.checkpoint.committed", 2),
            ("hybridrl.run.finished", "hybridrl-policy/1"),
        ], got

        # a run preempted (SIGTERM), and one whose driver is SIGKILLed, in step 2's reward
        # stage (the fault is that flow run's own environment): the worker reports the flow
        # run Preempted / Crashed, and the deployment's trigger on that state runs it again
        for action, state in (("term", "Preempted"), ("kill", "Crashed")):
            run_id = f"{state.lower()}-1"
            out = run_nightly(run_id, f"step-2/reward:start={action}")
            if state not in out and (uid := re.search(r"UUID: ([0-9a-f-]+)", out)):
                out += prefect("flow-run", "logs", uid.group(1), check=False)  # why, if it fails
            assert state in out, out
            states = wait_for_states(prefect_api, run_id, "Completed", 600)
            if sorted(states) != ["Completed", state]:  # the other runs' logs say why
                runs = [r for r in flow_runs(prefect_api, run_id) if r["state"]["name"] != state]
                logs = [prefect("flow-run", "logs", r["id"], check=False) for r in runs]
                raise AssertionError(f"{run_id}: flow run states {states}\n" + "\n".join(logs))
            assert (tmp_path / f"runs/{run_id}/final/COMMITTED").is_file()
        # the crashed run's restart counted, its MLflow run marked FAILED, then reopened
        doc = json.loads((tmp_path / "runs/crashed-1/run.json").read_text())
        assert doc["driver_restarts"] == {"count": 1, "step": 1}
        run = mlflow_run(mlflow_url, "crashed-1")  # marked FAILED, then reopened and finished
        assert run["info"]["status"] == "FINISHED"
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["hybridrl.driver_lost"].startswith("its process (pid ")
    finally:
        if worker is not None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:  # a worker's graceful shutdown once took over 30 s on a loaded machine
                worker.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(30)
        stop(mlflow_proc)


def mlflow_run(url: str, run_id: str) -> dict:
    """The MLflow run of training run `run_id`, through the server's REST API."""
    req = urllib.request.Request(
        f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=hybridrl"
    )
    exp_id = json.loads(urllib.request.urlopen(req).read())["experiment"]["experiment_id"]
    body = json.dumps(
        {"experiment_ids": [exp_id], "filter": f"tags.`hybridrl.run_id` = '{run_id}'"}
    ).encode()
    req = urllib.request.Request(
        f"{url}/api/2.0/mlflow/runs/search", data=body, headers={"Content-Type": "application/json"}
    )
    (run,) = json.loads(urllib.request.urlopen(req).read())["runs"]
    return run


def flow_runs(api: str, name: str) -> list[dict]:
    """The flow runs called `name` on the Prefect server at `api`."""
    body = json.dumps({"flow_runs": {"name": {"any_": [name]}}}).encode()
    req = urllib.request.Request(
        f"{api}/flow_runs/filter", data=body, headers={"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req).read())


def wait_for_states(
    api: str, name: str, final: str, timeout_s: float, other: frozenset[str] = frozenset()
) -> list[str]:
    """The state names of the flow runs called `name` (but those whose ids are in `other`:
    another test's on the same server), once one of them is `final`."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [r["state"]["name"] for r in flow_runs(api, name) if r["id"] not in other]
        if final in states or time.monotonic() > deadline:
            return states
        time.sleep(0.5)
