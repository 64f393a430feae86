"""One writer per run: a driver holds its run's lease; a second driver of the run refuses in
one line naming the holder, and takes over only once the holder is gone (its process dead on
this host, or its heartbeat older than storage.lease_timeout_s)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from conftest import PRISTINE_ENV, S3_ENV
from drivers import Driver
from run_driver import ARGS, ROOT, assert_same_run, final_state, fs_for, wait_for

from hybrid_engine.config import StorageConfig
from storage.lease import DIR, LeaseHeld, RunLease
from storage.store import RunStore


@pytest.mark.fast
def test_of_writers_racing_to_create_an_object_exactly_one_wins(store):
    won = []
    barrier = threading.Barrier(6)

    def create(i: int) -> None:
        barrier.wait(timeout=30)
        won.append((i, store.create("lease/1.json", json.dumps({"i": i}).encode())))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, ok in won if ok]
    assert len(winners) == 1 and len(won) == 6
    assert store.get_json("lease/1.json") == {"i": winners[0]}


@pytest.mark.fast
def test_a_second_driver_is_refused_naming_the_holder_until_it_releases(store):
    first = RunLease(store, timeout_s=60)
    assert first.acquire() is None
    second = RunLease(store, timeout_s=60)
    with pytest.raises(LeaseHeld) as refused:
        second.acquire()
    line = str(refused.value)
    assert "\n" not in line and f"pid {os.getpid()}" in line and "since 20" in line
    first.release()
    assert second.acquire() is None  # released: taken without a word
    assert store.get_json(f"{DIR}/2.json")["owner"] == second.doc["owner"]
    second.release()


@pytest.mark.fast
def test_a_dead_holder_on_this_host_is_taken_over_at_once(store):
    proc = subprocess.Popen(["sleep", "60"])
    started = psutil.Process(proc.pid).create_time()
    now = time.time()
    doc = {"owner": "x", "host": socket.gethostname(), "pid": proc.pid, "started": started}
    store.create(f"{DIR}/1.json", json.dumps({**doc, "since": now, "heartbeat": now}).encode())
    with pytest.raises(LeaseHeld):
        RunLease(store, timeout_s=60).acquire()
    proc.kill()  # not reaped: once the kill has landed, a zombie is gone too
    deadline = time.monotonic() + 30
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the killed process did not end"
        time.sleep(0.01)
    lease = RunLease(store, timeout_s=60)
    assert lease.acquire() == f"its process (pid {proc.pid}) is gone"
    lease.release()
    proc.wait(timeout=30)


@pytest.mark.fast
def test_a_stalled_holder_is_taken_over_and_then_commits_nothing(store):
    stalled = RunLease(store, timeout_s=0.4)
    stalled.acquire()
    store.guard = stalled.check
    stalled._stop.set()  # it stops renewing, as a SIGSTOPped driver would
    stalled._thread.join()
    with pytest.raises(LeaseHeld):
        RunLease(store, timeout_s=60).acquire()  # a 60 s timeout: still held
    time.sleep(0.5)
    other = RunLease(store, timeout_s=0.4)
    assert other.acquire().startswith("no heartbeat for ")
    stalled._start()  # it wakes up and finds it was taken over
    deadline = time.monotonic() + 5
    while not stalled.lost.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(LeaseHeld, match="another driver took this run over"):
        store.commit("steps/1/rollout", {}, {})
    assert not store.exists("steps/1/rollout/COMMITTED")
    other.release()
    assert other.generations() == [1, 2]


def files(root) -> list[str]:
    """The objects under `root` (not the temporary files of a write in progress)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp-" not in p.name)


def test_resume_while_the_run_trains_is_refused_and_the_run_is_unchanged(
    tmp_path, prefect_api, reference
):
    """`hybridrl resume RUN` while RUN's driver trains: one line naming the holder; the
    first driver finishes with the uninterrupted run's weights and metrics."""
    root = tmp_path / "runs"
    flag = tmp_path / "paused"
    env = {
        **PRISTINE_ENV,
        **S3_ENV,
        "PYTHONPATH": str(ROOT / "tests"),
        "PREFECT_API_URL": prefect_api,
    }
    args = ["train", "configs/grpo_tiny.yaml", *ARGS, f"storage.root={root}", "--run-id", "one"]
    first = Driver(args, {**env, "HYBRIDRL_FAULT": f"step-2/reward:start=pause:{flag}"})
    try:
        wait_for(flag, first)
        before = files(root)
        rc, out, err = Driver(["resume", "one", f"storage.root={root}"], env, merged=False).wait(
            timeout=300
        )
        assert rc == 1, out + err
        errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
        assert len(errors) == 1, out
        assert f"run one is being trained by pid {first.pid}" in errors[0]
        assert files(root) == before  # the refused driver wrote nothing
        flag.unlink()
        rc, out, _ = first.wait(timeout=400)
    finally:
        first.kill_group()
    assert rc == 0, out
    assert_same_run(final_state(fs_for(str(root), None), f"{root}/one"), reference)
    lease = json.loads((root / "one" / DIR / "1.json").read_text())
    assert lease["pid"] == first.pid and lease["released"] >= lease["since"]


@pytest.mark.fast
def test_deleting_a_run_that_trains_is_refused(tmp_path):
    from storage.catalog import delete_run

    cfg = StorageConfig(root=str(tmp_path / "runs"))
    store = RunStore(cfg, "r1")
    store.write_run({"created": time.time()})
    with RunLease(store, timeout_s=60), pytest.raises(LeaseHeld, match="stop it before deleting"):
        delete_run(cfg, "r1")


@pytest.mark.fast
def test_a_restart_waits_for_a_dead_holders_lease_but_not_for_a_live_one(store):
    """A restart after a crash on another host: the dead driver's heartbeat has to age past
    the timeout, which `acquire(wait_s)` waits for, saying so once; a live holder keeps its
    lease through the wait."""
    live = RunLease(store, timeout_s=0.8)
    live.acquire()
    said = []
    began = time.monotonic()
    with pytest.raises(LeaseHeld, match="being trained by pid"):
        RunLease(store, timeout_s=0.8).acquire(wait_s=1.5, say=said.append)
    assert time.monotonic() - began >= 1.5
    assert len(said) == 1 and "waiting up to 1.5 s for it to lapse" in said[0]
    live._stop.set()  # its heartbeat stops, as a SIGKILLed driver's on another host would
    live._thread.join()
    restart = RunLease(store, timeout_s=0.8)
    assert restart.acquire(wait_s=30).startswith("no heartbeat for ")
    restart.release()


@pytest.mark.fast
def test_restarts_in_a_row_that_commit_nothing_stop_at_the_budget(store):
    from tasks.restarts import CrashLoop, count_restart

    doc = {}
    for count in (1, 2):
        doc["driver_restarts"] = count_restart(store, doc, 2, restarted=True)
        assert doc["driver_restarts"] == {"count": count, "step": 0}
    with pytest.raises(CrashLoop) as loop:
        count_restart(store, doc, 2, restarted=True)
    line = str(loop.value)
    assert "\n" not in line and "died 3 times in a row" in line
    assert "pipeline.max_driver_restarts=2" in line and "hybridrl resume r1" in line
    store.commit_stage(1, "update", None, {"step": 1})  # progress: the count starts again
    assert count_restart(store, doc, 2, restarted=True) == {"count": 1, "step": 1}
    # a person's resume starts it again too
    assert count_restart(store, doc, 2, restarted=False) == {"count": 0, "step": 1}


def test_a_restarted_crash_loop_stops_in_one_line_with_mlflow_failed(tmp_path, prefect_api):
    """A driver SIGKILLed in step 1; the trigger's restart (`restarted=True`) with
    pipeline.max_driver_restarts=0 takes the dead driver's lease, marks its MLflow run
    FAILED and refuses; a person's resume then finishes the run, MLflow FINISHED."""
    from mlflow.tracking import MlflowClient

    root, db = tmp_path / "runs", f"sqlite:///{tmp_path}/mlflow.db"
    env = {
        **PRISTINE_ENV,
        **S3_ENV,
        "PYTHONPATH": str(ROOT / "tests"),
        "PREFECT_API_URL": prefect_api,
    }
    where = [f"storage.root={root}", "tracking.enabled=true", f"tracking.uri={db}"]
    args = ["train", "configs/grpo_tiny.yaml", *ARGS, *where, "--run-id", "loop"]
    rc, out, _ = Driver(args, {**env, "HYBRIDRL_FAULT": "step-1/reward:start=kill"}).wait(
        timeout=300
    )
    assert rc == -9, out
    doc = json.loads((root / "loop" / "run.json").read_text())
    client = MlflowClient(db)
    assert client.get_run(doc["mlflow_run_id"]).info.status == "RUNNING"  # left by the kill
    restart = (
        "from flows.train import train\n"
        f"train(resume_from='loop', overrides={[*where, 'pipeline.max_driver_restarts=0']!r}, "
        "restarted=True)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", restart],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1
    assert p.stderr.splitlines()[-1].startswith(
        "tasks.restarts.CrashLoop: run loop: its driver died 1 time in a row"
    ), p.stderr[-3000:]
    run = client.get_run(doc["mlflow_run_id"])
    assert run.info.status == "FAILED"
    assert run.data.tags["hybridrl.driver_lost"].startswith("its process (pid ")
    lease = RunLease(RunStore(StorageConfig(root=str(root)), "loop"), 60)
    assert lease.holder()[1]["released"]  # the refusing driver let go of the run
    rc, out, _ = Driver(["resume", "loop", *where], env).wait(timeout=400)
    assert rc == 0, out
    assert client.get_run(doc["mlflow_run_id"]).info.status == "FINISHED"
    doc = json.loads((root / "loop" / "run.json").read_text())
    assert doc["driver_restarts"]["count"] == 0


def snapshot(store) -> dict[str, bytes]:
    """Every object of the run but the lease's own (its holder keeps renewing)."""
    out = {}
    for path in store.fs.find(store.path):
        rel = path.removeprefix(store.path.lstrip("/") if not store.local else store.path)
        rel = rel.lstrip("/")
        if not rel.startswith(f"{DIR}/") and ".tmp-" not in rel:
            out[rel] = store.fs.cat_file(path)
    return out


def taken_over(store) -> tuple[RunLease, RunStore]:
    """`store`'s driver stalls, another driver takes the run over and commits step 1's
    rollout, a checkpoint and run.json; the stalled one wakes and finds it lost the run.
    Returns the new holder's lease and store."""
    stalled = RunLease(store, timeout_s=0.4)
    stalled.acquire()
    store.guard = stalled.check
    store.commit_stage(1, "rollout", None, {"by": "stalled"})
    stalled._stop.set()  # it stops renewing, as a SIGSTOPped driver would
    stalled._thread.join()
    time.sleep(0.5)
    mine = RunStore(store.cfg, store.run_id)
    other = RunLease(mine, timeout_s=0.4)
    assert other.acquire().startswith("no heartbeat for ")
    mine.guard = other.check
    mine.commit_stage(1, "rollout", None, {"by": "new holder"})
    mine.commit_checkpoint(1, {}, {"by": "new holder"})
    mine.write_run({"by": "new holder"})
    stalled._start()  # it wakes up and finds it was taken over
    deadline = time.monotonic() + 5
    while not stalled.lost.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stalled.lost.is_set()
    return other, mine


@pytest.mark.fast
def test_a_taken_over_driver_is_refused_before_it_changes_anything(store):
    """Every write that changes the run's state is refused before it touches an object:
    a redone stage does not un-commit the new holder's, a checkpoint writes no meta.json,
    latest.json, run.json and deletes are refused too."""
    other, mine = taken_over(store)
    before = snapshot(store)
    writes = {
        "commit_stage": lambda: store.commit_stage(1, "rollout", None, {"by": "stalled"}),
        "commit_checkpoint": lambda: store.commit_checkpoint(1, {}, {"by": "stalled"}),
        "set_latest": lambda: store.set_latest(step=7),
        "write_run": lambda: store.write_run({"by": "stalled"}),
        "remove": lambda: store.remove("steps/1/rollout"),
        "drop_checkpoint": lambda: store.drop_checkpoint(1),
        "put_json": lambda: store.put_json("steps/1/rollout/meta.json", {}),
    }
    for name, write in writes.items():
        with pytest.raises(LeaseHeld, match="another driver took this run over"):
            write()
        assert snapshot(store) == before, f"{name} changed the run before it was refused"
    assert mine.load_stage(1, "rollout").meta == {"by": "new holder"}
    other.release()


@pytest.mark.fast
def test_a_pickled_store_keeps_its_guard(store):
    """The store that goes to other processes (pickled) writes while its driver holds the
    run, and is refused, from storage alone, once another driver took it over."""
    import pickle

    lease = RunLease(store, timeout_s=60)
    lease.acquire()
    store.guard = lease.check
    copy = pickle.loads(pickle.dumps(store))
    copy.put("checkpoints/step_1/actor/w.bin", b"held")  # the holder's copy writes
    lease._stop.set()
    lease._thread.join()
    lease.timeout_s = 0.01  # its heartbeat is old at once
    time.sleep(0.05)
    other = RunLease(RunStore(store.cfg, store.run_id), timeout_s=0.01)
    assert other.acquire().startswith("no heartbeat for ")
    with pytest.raises(LeaseHeld, match="another driver took this run over"):
        copy.put("checkpoints/step_1/actor/w.bin", b"stale")
    assert store.get("checkpoints/step_1/actor/w.bin") == b"held"
    other.release()


@pytest.mark.fast
def test_stages_committed_before_the_fenced_lease_still_resume(store):
    """A stage and a checkpoint in today's layout (markers without a generation), as a run
    stored before the fence has them, read back, count as committed and are skipped."""
    batch_doc = {"files": {}, "committed_at": 1.0, "writer_pid": 1, "step": 1}
    meta = b'{"metrics": {"m": 1.0}}'
    files = {"meta.json": store.put("steps/1/rollout/meta.json", meta)}
    store.put_json("steps/1/rollout/COMMITTED", {**batch_doc, "files": files, "stage": "rollout"})
    ck = {"meta.json": store.put("checkpoints/step_1/meta.json", b'{"kl_coef": 0.5}')}
    store.put_json("checkpoints/step_1/COMMITTED", {**batch_doc, "files": ck})
    lease = RunLease(store, timeout_s=60)
    lease.acquire()
    store.guard = lease.check
    assert store.load_stage(1, "rollout").meta == {"metrics": {"m": 1.0}}
    assert store.is_committed(1, "rollout") and store.checkpoints() == [1]
    assert store.checkpoint_files(1)[1] == {"kl_coef": 0.5}
    store.commit_stage(1, "reward", None, {"metrics": {}})  # the run goes on from there
    assert store.is_committed(1, "reward")
    lease.release()


@pytest.mark.fast
def test_a_holder_whose_heartbeats_fail_stops_writing_by_itself(s3_endpoint):
    """A storage partition: the holder's heartbeats fail, so another driver may take the run
    over once they are older than the timeout; the holder stops writing by itself by then,
    before it has heard of any takeover, and stays stopped when storage heals."""
    from servers import TcpProxy

    proxy = TcpProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    bucket = f"partition-{int(time.time() * 1e6)}"
    cfg = StorageConfig(
        root=f"s3://{bucket}/runs", endpoint_url=f"http://127.0.0.1:{proxy.port}", retries=0
    )
    store = RunStore(cfg.model_copy(update={"timeout_s": 0.5}), "r1")
    store.fs.mkdir(bucket)
    lease = RunLease(store, timeout_s=1.0)
    lease.acquire()
    store.guard = lease.check
    store.commit_stage(1, "rollout", None, {"by": "holder"})
    proxy.cut()
    time.sleep(1.5)  # past the timeout: heartbeats failed all along
    proxy.restore()
    with pytest.raises(LeaseHeld):
        store.commit_stage(1, "reward", None, {"by": "holder"})
    time.sleep(0.6)  # storage is back: the renew thread must not take the lease up again
    with pytest.raises(LeaseHeld):
        store.set_latest(step=1)
    assert not store.exists("steps/1/reward/COMMITTED")
    lease.release()
    proxy.cut()


@pytest.mark.fast
def test_the_takeover_timeout_outlasts_the_holders_own_retries():
    """One S3 request may take (retries + 1) x (connect + read timeout) plus backoff; the
    lease timeout is derived from that, and a smaller one is refused naming the fields."""
    cfg = StorageConfig(root="s3://b/runs", timeout_s=10, retries=2)
    assert cfg.lease_timeout_s >= 3 * (2 + 1) * 2 * 10
    assert StorageConfig(root="runs").lease_timeout_s == 60  # a local disk: no request bound
    with pytest.raises(ValueError) as refused:
        StorageConfig(root="s3://b/runs", timeout_s=60, retries=4, lease_timeout_s=60)
    line = str(refused.value).splitlines()
    assert any(
        "storage.lease_timeout_s=60" in x and "storage.timeout_s" in x and "storage.retries" in x
        for x in line
    ), line


@pytest.mark.fast
def test_a_driver_that_released_its_lease_writes_no_more(store):
    """Once released, another driver may take the run at once: the releasing one's store
    (and a pickled copy of it) refuses every write."""
    import pickle

    lease = RunLease(store, timeout_s=60)
    lease.acquire()
    lease.fence(store)
    copy = pickle.loads(pickle.dumps(store))
    store.commit_stage(1, "rollout", None, {"by": "holder"})
    lease.release()
    for s in (store, copy):
        with pytest.raises(LeaseHeld):
            s.set_latest(step=9)
    assert store.read_latest()["step"] == 1


@pytest.mark.fast
def test_an_s3_run_stored_before_the_derived_timeout_still_resumes():
    """run.json of an S3 run recorded before the timeout was derived holds the old default
    storage.lease_timeout_s=60 (and no storage.single_driver): its config still loads, with
    the derived timeout, so the run resumes."""
    from hybrid_engine.config import load_config
    from hybrid_engine.config.loading import config_from_dict

    doc = load_config(None, []).model_dump(mode="json")
    doc["storage"] = {
        "root": "s3://b/runs",
        "endpoint_url": None,
        "timeout_s": 60.0,
        "retries": 4,
        "lease_timeout_s": 60.0,
        "shared_filesystem": False,
    }
    cfg = config_from_dict(doc)
    assert cfg.storage.lease_timeout_s == 3 * cfg.storage.request_bound_s
