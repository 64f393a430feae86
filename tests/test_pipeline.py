"""The stage pipeline's definition of done: a run killed anywhere and resumed equals the
uninterrupted run.

Every run here is a real driver process (`hybridrl train` / `hybridrl resume`, the Prefect
`train` flow against a real Prefect API) killed with SIGKILL at a named point
(`HYBRIDRL_FAULT`, see storage/faults.py): in each of the four stages (after the stage's
objects are written, before its commit marker) and between steps. The final weights must be
bit-identical to the uninterrupted run's and the per-step metrics equal; a rollout committed
before a crash is never generated again (its marker and objects stay byte-for-byte the same).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

from conftest import PRISTINE_ENV, S3_ENV
from drivers import Driver
from run_driver import (
    ARGS,
    KILLS,
    ROOT,
    STEPS,
    assert_same_run,
    driver,
    final_state,
    fs_for,
    rollout_markers,
    wait_for,
)


def killed_and_resumed(
    root: str,
    run_id: str,
    prefect_api: str,
    endpoint: str | None,
    extra: list[str],
    kills: list[str],
    env=None,
    before_last=None,
):
    """Start the run, kill it at each point in turn, resuming after each kill."""
    fs = fs_for(root, endpoint)
    run_url = f"{root}/{run_id}"
    where = [f"storage.root={root}"] + ([f"storage.endpoint_url={endpoint}"] if endpoint else [])
    logs = []
    for i, point in enumerate(kills):
        args = (
            ["train", "configs/grpo_tiny.yaml", *ARGS, *extra, *where, "--run-id", run_id]
            if i == 0
            else ["resume", run_id, *where]
        )
        before = rollout_markers(fs, run_url)
        rc, out = driver(args, prefect_api, fault=f"{point}=kill", extra_env=env)
        logs.append(out)
        assert rc == -signal.SIGKILL, f"expected a kill at {point}:\n{out}"
        after = rollout_markers(fs, run_url)
        assert all(after[k] == v for k, v in before.items()), "a committed rollout was redone"
    if before_last:
        before_last(fs, run_url)
    before = rollout_markers(fs, run_url)
    rc, out = driver(["resume", run_id, *where], prefect_api, extra_env=env)
    assert rc == 0, out
    after = rollout_markers(fs, run_url)
    assert all(after[k] == v for k, v in before.items()), "a committed rollout was redone"
    assert len(after) == STEPS
    return final_state(fs, run_url), logs + [out]


def corrupt(fs, path: str) -> None:
    data = bytearray(fs.cat_file(path))
    data[-1] ^= 0xFF
    fs.pipe_file(path, bytes(data))


def test_killed_in_every_stage_and_between_steps_resumes_exactly(tmp_path, prefect_api, reference):
    """Also: before the last resume one byte of step 3's committed advantage batch is
    flipped. That resume loads the step-2 checkpoint and replays step 3 from storage, finds
    the corruption (a warning names the object), recomputes that stage from the committed
    reward stage, and still ends exactly like the uninterrupted run."""
    bad = f"{tmp_path}/chain/steps/3/advantage/batch.safetensors"
    mlflow_db = f"sqlite:///{tmp_path}/mlflow.db"
    tracking = ["tracking.enabled=true", f"tracking.uri={mlflow_db}"]
    got, logs = killed_and_resumed(
        str(tmp_path),
        "chain",
        prefect_api,
        None,
        tracking,
        KILLS,
        before_last=lambda fs, _: corrupt(fs, bad),
    )
    assert_same_run(got, reference)
    # MLflow: the six driver processes wrote one MLflow run, each step's metrics once
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_db)
    (run,) = client.search_runs([client.get_experiment_by_name("hybridrl").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "chain"
    steps = lambda key: [m.step for m in client.get_metric_history(run.info.run_id, key)]  # noqa: E731
    assert sorted(steps("critic/score/mean")) == [1, 2, 3, 4]
    assert sorted(steps("val/accuracy")) == [0, 2, 4]
    logged = {r["step"]: r for r in got[1]}
    assert run.data.metrics["actor/pg_loss"] == logged[STEPS]["actor/pg_loss"]
    tables = [a.path for a in client.list_artifacts(run.info.run_id, "generations")]
    assert tables == [f"generations/step_{s:06d}.json" for s in (0, 2, 4)]
    # what the last resume found: killed in step 4's update, the checkpoint of step 2 is
    # loaded and step 3's update replayed; step 4's first three stages come from storage
    assert "loaded checkpoint step_2" in logs[-1] and "replaying 1 committed update" in logs[-1]
    assert f"{bad}: sha256 differs from the committed one" in logs[-1]
    assert "(from storage: rollout, reward, advantage)" in logs[-1]
    # a resume asking for fewer steps than are done says so, trains nothing, changes nothing
    rc, out = driver(
        ["resume", "chain", "trainer.total_training_steps=2", f"storage.root={tmp_path}"],
        prefect_api,
    )
    assert rc == 0, out
    assert "4 steps done" in out and "nothing to train" in out and "step-3/" not in out
    assert_same_run(final_state(fs_for(str(tmp_path), None), f"{tmp_path}/chain"), reference)


def test_on_the_pool_a_resume_reattaches_or_reloads(tmp_path, prefect_api, reference):
    """trainer.backend=ray: the pool outlives the killed driver. Killed between steps 2 and
    3, the next driver finds the pool holding this run's version 2 and re-attaches (nothing
    loaded); killed in step 4's update, the pool went on to version 4 without a commit, so
    the next driver loads checkpoint step_2 into the pool and replays step 3."""
    from hybrid_engine.pool import pool

    env = {"HYBRIDRL_RAY_STATE": str(tmp_path / "ray")}
    extra = ["trainer.backend=ray", "ray.pool_name=pipeline", "ray.call_timeout_s=120"]

    def cli(*args: str) -> subprocess.CompletedProcess:
        rc, out = driver(list(args), prefect_api, extra_env=env, timeout=120)
        return subprocess.CompletedProcess(args, rc, out, "")

    status = None
    try:
        got, logs = killed_and_resumed(
            str(tmp_path / "runs"),
            "pool",
            prefect_api,
            None,
            extra,
            ["step-2:end", "step-4/update:before_commit"],
            env,
        )
        status = cli("pool", "status", "--pool", "pipeline")
    finally:
        head = json.loads((tmp_path / "ray" / "head.json").read_text())["temp_dir"]
        down = cli("pool", "down", "--pool", "pipeline")
        assert "stopped 1 worker(s)" in down.stdout, down.stdout + down.stderr
    assert not pool.head_processes(head), "the local Ray head outlived `pool down`"
    assert "no local head is running" in cli("pool", "status", "--pool", "pipeline").stdout
    # while it was up: one healthy worker holding the run's last weights version
    assert status.returncode == 0 and status.stdout.count(" ok ") == 1, status.stdout
    assert "actor-0" in status.stdout and "0/1" in status.stdout and f" {STEPS} " in status.stdout
    assert "local Ray head: 127.0.0.1:" in status.stdout, status.stdout
    assert "worker pool 'pipeline' stays up" in logs[-1]
    assert "the engine holds weights version 2: nothing to load" in logs[1]
    assert "loaded checkpoint step_2 (the engine held version 4)" in logs[2]
    assert_same_run(got, reference)  # 1 pool rank computes exactly what the local roles do
    assert got[1][-1]["perf/actor-0/peak_rss_gb"] > 0  # the worker's memory, per step


def test_same_on_s3(prefect_api, s3_endpoint, reference):
    fs = fs_for("s3://", s3_endpoint)
    bucket = f"hybridrl-test-{int(time.time() * 1000)}"
    fs.mkdir(bucket)
    # the kill points' logic is the local chain's; here: a kill before a stage's commit and
    # one before an update's commit after a checkpoint, on S3
    kills = ["step-2/reward:before_commit", "step-4/update:before_commit"]
    got, _ = killed_and_resumed(f"s3://{bucket}/runs", "chain", prefect_api, s3_endpoint, [], kills)
    assert_same_run(got, reference)
    run = json.loads(fs.cat_file(f"{bucket}/runs/chain/run.json"))
    assert "testing" not in json.dumps(run)  # credentials never reach storage


def test_s3_outage_mid_write_commits_nothing_and_resume_recovers(
    tmp_path, prefect_api, s3_endpoint, reference
):
    """The network path to S3 is cut after step 2's rollout objects are written and before
    its marker: the task's retries fail, the flow fails, the stage stays uncommitted; with
    S3 back, resume finishes the run exactly."""
    from servers import TcpProxy

    direct = fs_for("s3://", s3_endpoint)
    bucket = f"hybridrl-outage-{int(time.time() * 1000)}"
    direct.mkdir(bucket)
    proxy = TcpProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    endpoint = f"http://127.0.0.1:{proxy.port}"
    flag = tmp_path / "paused"
    args = [
        "train",
        "configs/grpo_tiny.yaml",
        *ARGS,
        f"storage.root=s3://{bucket}/runs",
        f"storage.endpoint_url={endpoint}",
        "storage.timeout_s=2",
        "storage.retries=1",
        "pipeline.retries=1",
        "--run-id",
        "outage",
    ]
    env = {
        **PRISTINE_ENV,
        **S3_ENV,
        "PYTHONPATH": str(ROOT / "tests"),
        "PREFECT_API_URL": prefect_api,
        "HYBRIDRL_FAULT": f"step-2/rollout:before_commit=pause:{flag}",
    }
    proc = Driver(args, env)
    wait_for(flag, proc)
    stage = f"{bucket}/runs/outage/steps/2/rollout"
    assert direct.exists(f"{stage}/batch.safetensors")  # objects written ...
    proxy.cut()  # ... and S3 is gone before the marker
    flag.unlink()
    rc, out, _ = proc.wait(timeout=300)
    assert rc == 1, out
    assert "error:" in out and "Traceback" not in out
    assert out.count("Task run 'step-2/rollout'") >= 2  # retried before failing
    direct.invalidate_cache()
    assert not direct.exists(f"{stage}/COMMITTED")  # the stage did not happen
    assert direct.exists(f"{bucket}/runs/outage/steps/1/update/COMMITTED")

    proxy.restore()
    rc, out = driver(
        [
            "resume",
            "outage",
            f"storage.root=s3://{bucket}/runs",
            f"storage.endpoint_url={endpoint}",
        ],
        prefect_api,
    )
    assert rc == 0, out
    proxy.cut()
    assert_same_run(final_state(direct, f"{bucket}/runs/outage"), reference)
