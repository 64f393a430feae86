"""Self-healing runs: each fault kind once, on a real driver process (`hybridrl train`, the
Prefect flow against a real Prefect API) with faults injected at named points
(`HYBRIDRL_FAULT`, storage/faults.py).

A worker killed mid-update and a worker stopped with SIGSTOP are recovered from with nobody
at the keyboard, and the run ends with the uninterrupted run's exact weights; past
pipeline.max_recoveries the run stops with one line and a resume finishes it; SIGTERM ends
the flow run "Preempted" with exit status 143 and a resume finishes it exactly; a NaN update
is refused before any checkpoint; a full disk fails the checkpoint cleanly, keeps the older
one, and a resume with space again finishes exactly.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from run_driver import ARGS, ROOT, assert_same_run, driver, final_state, fs_for, own_ray_head

POOL = [
    "trainer.backend=ray",
    "ray.pool_name=recovery",
    "ray.call_timeout_s=120",
    "pipeline.recovery_delay_s=0.2",
]


@pytest.fixture()
def ray_state(tmp_path, prefect_api):
    """The pool's own local head, stopped at the end with nothing left running."""
    with own_ray_head(tmp_path / "ray", "recovery", prefect_api) as env:
        yield env


def train(
    tmp_path: Path,
    run_id: str,
    extra: list[str],
    prefect_api: str,
    fault: str,
    env: dict | None = None,
) -> tuple[int, str]:
    args = [
        "train",
        "configs/grpo_tiny.yaml",
        *ARGS,
        *extra,
        f"storage.root={tmp_path}/runs",
        "--run-id",
        run_id,
    ]
    return driver(args, prefect_api, fault=fault, extra_env=env)


def test_a_dead_and_a_hung_worker_are_recovered_and_the_run_is_exact(
    tmp_path, prefect_api, reference, ray_state
):
    """actor-0 is killed (kill -9) 0.1 s into step 2's update, then stopped (SIGSTOP) as
    step 4's rollout starts: the first fails the call at once, the second is declared hung
    after the rollout's time limit (max(3 s, 5 x its slowest wall time))."""
    db = f"sqlite:///{tmp_path}/mlflow.db"
    fault = "step-2/update:start=kill-worker:actor-0@0.1;step-4/rollout:start=stop-worker:actor-0"
    rc, out = train(
        tmp_path,
        "healed",
        [*POOL, "pipeline.stage_timeout_s=3", "tracking.enabled=true", f"tracking.uri={db}"],
        prefect_api,
        fault,
        ray_state,
    )
    assert rc == 0, out
    assert "recovered from 2 worker fault(s)" in out
    assert_same_run(final_state(fs_for(str(tmp_path), None), f"{tmp_path}/runs/healed"), reference)
    run = json.loads((tmp_path / "runs" / "healed" / "run.json").read_text())
    events = run["recoveries"]
    assert [(e["worker"], e["how"]) for e in events] == [("actor-0", "died"), ("actor-0", "hung")]
    assert (
        events[1]["where"] == "step-4/rollout" and "did not answer within 3 s" in events[1]["error"]
    )
    assert all(e["rebuild_s"] > 0 for e in events)
    assert out.count("hybridrl.recovery - recovery ") == 4  # announced, then done, per fault
    from mlflow.tracking import MlflowClient

    client = MlflowClient(db)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("hybridrl").experiment_id])
    assert mlrun.info.status == "FINISHED" and mlrun.data.tags["hybridrl.recoveries"] == "2"
    history = client.get_metric_history(mlrun.info.run_id, "recoveries")
    assert [(m.step, m.value) for m in history] == [(events[0]["step"], 1.0), (4, 2.0)]


def test_past_max_recoveries_the_run_stops_in_one_line_and_a_resume_finishes_it(
    tmp_path, prefect_api, reference, ray_state
):
    rc, out = train(
        tmp_path,
        "capped",
        [*POOL, "pipeline.max_recoveries=0"],
        prefect_api,
        "step-3/reward:start=kill-worker:actor-0",
        ray_state,
    )
    assert rc == 1, out
    (line,) = [x for x in out.splitlines() if x.startswith("error:")]
    assert "RecoveryExhausted: actor-0 died 1x: 1 worker faults, more than " in line
    assert "pipeline.max_recoveries=0" in line and "`hybridrl resume capped`" in line
    # the dead worker's name is gone: the resume creates the pool anew, loads the last
    # checkpoint and ends like the uninterrupted run
    rc, out = driver(
        ["resume", "capped", f"storage.root={tmp_path}/runs"], prefect_api, extra_env=ray_state
    )
    assert rc == 0, out
    assert "starting at step 3 (loaded checkpoint step_2" in out
    assert_same_run(final_state(fs_for(str(tmp_path), None), f"{tmp_path}/runs/capped"), reference)


def test_sigterm_preempts_with_exit_143_and_a_resume_is_exact(tmp_path, prefect_api, reference):
    db = f"sqlite:///{tmp_path}/mlflow.db"
    tracking = ["tracking.enabled=true", f"tracking.uri={db}"]
    rc, out = train(tmp_path, "pre", tracking, prefect_api, "step-3/advantage:start=term")
    assert rc == 143, out
    assert "Finished in state Preempted(" in out
    assert "continue with `hybridrl resume pre`" in out and "error:" not in out
    steps = tmp_path / "runs" / "pre" / "steps"
    assert (steps / "3" / "reward" / "COMMITTED").exists()
    assert not (steps / "3" / "advantage").exists()  # nothing of the interrupted stage
    assert not list((tmp_path / "runs").rglob(".tmp-*"))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(db)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("hybridrl").experiment_id])
    assert mlrun.info.status == "KILLED"
    rc, out = driver(["resume", "pre", f"storage.root={tmp_path}/runs"], prefect_api)
    assert rc == 0, out
    assert_same_run(final_state(fs_for(str(tmp_path), None), f"{tmp_path}/runs/pre"), reference)
    # step 1's update record flipped on disk, before checkpoint step_2: it cannot be redone
    # (its starting weights are gone); a longer resume says what is kept and what is lost
    meta = steps / "1" / "update" / "meta.json"
    meta.write_bytes(meta.read_bytes()[:-1] + b" ")
    rc, out = driver(
        ["resume", "pre", f"storage.root={tmp_path}/runs", "trainer.total_training_steps=5"],
        prefect_api,
    )
    assert rc == 0, out
    assert "step 1: steps/1/update is corrupted: the weights it made are kept" in out
    summary = json.loads((tmp_path / "runs" / "pre" / "final" / "summary.json").read_text())
    assert [r["step"] for r in summary["history"]] == [0, 1, 2, 3, 4, 5]
    assert "metrics are lost" in summary["history"][1]["lost"] and summary["steps"] == 5


def test_a_nan_update_fails_the_run_before_any_checkpoint(tmp_path, prefect_api):
    nan = ["algorithm.plugins=[plugin_nan]", "actor.policy_loss.mode=plugin_nan"]
    rc, out = train(tmp_path, "nan", nan, prefect_api, None)
    assert rc == 1, out
    (line,) = [x for x in out.splitlines() if x.startswith("error:")]
    assert "NonFiniteUpdate: step 1: actor update refused" in line and "micro-batch 0" in line
    run = tmp_path / "runs" / "nan"
    assert not (run / "checkpoints").exists() and not (run / "final").exists()
    assert not (run / "steps" / "1" / "update").exists()


@contextlib.contextmanager
def small_disk(path: Path, megabytes: int):
    """A tmpfs of `megabytes` at `path` (needs the right to mount: root, as CI runs)."""
    path.mkdir()
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {got.stderr.strip()}")
    try:
        yield lambda mb: subprocess.run(
            ["mount", "-o", f"remount,size={mb}m", str(path)], check=True, timeout=60
        )
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, timeout=60)


def test_a_full_disk_fails_the_checkpoint_cleanly_and_keeps_the_older_one(
    tmp_path, prefect_api, reference
):
    """60 MB hold step 2's checkpoint (38 MB) but not step 4's beside it: the write fails
    naming the object, step_4 gets no marker, step_2 stays; with space again, a resume
    finishes exactly."""
    with small_disk(tmp_path / "disk", 60) as grow:
        root = f"{tmp_path}/disk"
        args = [
            "train",
            "configs/grpo_tiny.yaml",
            *ARGS,
            "trainer.max_ckpt_to_keep=1",
            f"storage.root={root}",
            "--run-id",
            "full",
        ]
        rc, out = driver(args, prefect_api)
        assert rc == 1, out
        (line,) = [x for x in out.splitlines() if x.startswith("error:")]
        assert "No space left on device: writing " in line and "checkpoints/step_4/" in line
        assert out.count("Task run 'step-4/checkpoint'") == 1  # a full disk is not retried
        ckpts = Path(root) / "full" / "checkpoints"
        assert (ckpts / "step_2" / "COMMITTED").exists()
        assert not (ckpts / "step_4" / "COMMITTED").exists()
        grow(200)
        rc, out = driver(["resume", "full", f"storage.root={root}"], prefect_api)
        assert rc == 0, out
        assert "loaded checkpoint step_2" in out
        assert_same_run(final_state(fs_for(root, None), f"{root}/full"), reference)


def test_a_resume_ends_the_prefect_server_a_sigkilled_driver_left(tmp_path):
    """Without PREFECT_API_URL each driver starts Prefect's ephemeral API as a child process;
    a driver killed with SIGKILL leaves it running. The resume finds it through run.json
    (pid and start time) and ends it."""
    import os
    import signal
    import sys

    import psutil
    from run_driver import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "PREFECT_HOME": str(tmp_path / "ph")}
    env.pop("PREFECT_API_URL", None)
    args = [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        "configs/grpo_tiny.yaml",
        *ARGS,
        f"storage.root={tmp_path}/runs",
        "--run-id",
        "orphan",
    ]
    log = tmp_path / "driver.log"  # not a pipe: the orphaned server would hold it open
    with open(log, "w") as f:
        proc = subprocess.run(
            args,
            cwd=ROOT,
            env={**env, "HYBRIDRL_FAULT": "step-2:end=kill"},
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=600,
        )
    servers = []
    try:
        assert proc.returncode == -signal.SIGKILL, log.read_text()
        run = json.loads((tmp_path / "runs" / "orphan" / "run.json").read_text())
        servers = [s["pid"] for s in run["driver"]["servers"]]
        assert servers and all(psutil.pid_exists(p) for p in servers)  # left behind
        with open(log, "w") as f:
            resumed = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "flows.cli",
                    "resume",
                    "orphan",
                    f"storage.root={tmp_path}/runs",
                ],
                cwd=ROOT,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=600,
            )
        assert resumed.returncode == 0, log.read_text()
        assert "left by the killed driver" in log.read_text()
        gone = lambda p: not psutil.pid_exists(p) or psutil.Process(p).status() == "zombie"  # noqa: E731
        assert all(gone(p) for p in servers)
    finally:
        for p in servers:
            with contextlib.suppress(psutil.Error):
                psutil.Process(p).kill()


def test_a_driver_killed_before_run_json_exists_counts_against_the_restart_budget(
    tmp_path, prefect_api
):
    """A new run's driver SIGKILLed while it starts its engine (before run.json exists, as
    an OOM-kill while loading the model), then restarted as the deployment's trigger on
    Crashed does (`restarted` = the restarts in a row so far, from the crashed flow run's
    own parameter): with pipeline.max_driver_restarts=1 the first restart is let through
    (and killed again), the second is refused in one line before it loads anything."""
    import sys

    from conftest import PRISTINE_ENV
    from drivers import Driver

    root = tmp_path / "runs"
    env = {
        **PRISTINE_ENV,
        "PYTHONPATH": str(ROOT / "tests"),
        "PREFECT_API_URL": prefect_api,
        "HYBRIDRL_FAULT": "driver:start-engine=kill",
    }
    where = [*ARGS, f"storage.root={root}", "pipeline.max_driver_restarts=1"]
    rc, out, _ = Driver(["train", "configs/grpo_tiny.yaml", *where, "--run-id", "early"], env).wait(
        timeout=300
    )
    assert rc == -9, out
    assert not (root / "early" / "run.json").exists()

    def restart(n: int) -> subprocess.CompletedProcess:
        code = (
            "from flows.train import train\n"
            f"train(config='configs/grpo_tiny.yaml', resume_from='early', overrides={where!r}, "
            f"restarted={n})\n"
        )
        return subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    p = restart(1)
    assert p.returncode == -9, p.stderr[-3000:]
    assert not (root / "early" / "run.json").exists()
    p = restart(2)
    assert p.returncode == 1, p.stderr[-3000:]
    assert p.stderr.splitlines()[-1].startswith(
        "tasks.restarts.CrashLoop: run early: its driver died 2 times in a row"
    ), p.stderr[-3000:]
    assert not (root / "early" / "run.json").exists()


@pytest.mark.fast
def test_the_crashed_trigger_counts_each_restart_in_its_parameters():
    """The training deployments' trigger on Crashed, rendered by Prefect's own parameter
    hydration as its automation service does, passes `restarted` = the crashed flow run's
    own count + 1 (0 for a run a person or a schedule started; `true` from an older
    trigger counts as 1)."""
    import yaml
    from prefect.server.events.actions import RunDeployment
    from prefect.server.events.schemas.events import Event
    from prefect.server.schemas.core import FlowRun
    from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate

    files = [
        ROOT / "deployments" / "prefect.yaml",
        ROOT / "deployments/cluster/prefect/prefect.yaml",
    ]
    triggers = [
        t
        for f in files
        for d in yaml.safe_load(f.read_text())["deployments"]
        for t in d.get("triggers", [])
        if t["expect"] == ["prefect.flow-run.Crashed"]
    ]
    assert len(triggers) == 4
    crashed = Event(
        occurred=datetime.now(UTC),
        event="prefect.flow-run.Crashed",
        resource={
            "prefect.resource.id": f"prefect.flow-run.{uuid.uuid4()}",
            "prefect.resource.name": "r1",
        },
        id=uuid.uuid4(),
    )
    cases = [({}, 1), ({"restarted": False}, 1), ({"restarted": True}, 2), ({"restarted": 4}, 5)]
    for trigger in triggers:
        for given, expected in cases:
            params = dict(trigger["parameters"])
            RunDeployment._upgrade_v1_templates(params)
            run = FlowRun(flow_id=uuid.uuid4(), name="r1", parameters=given)
            context = {"flow_run": run, "event": crashed}
            out = hydrate(params, HydrationContext(render_jinja=True, jinja_context=context))
            assert out == {"resume_from": "r1", "restarted": expected}, (given, out)
            assert type(out["restarted"]) is int, (given, out)  # not True, which == 1
