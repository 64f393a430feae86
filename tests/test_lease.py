"""One writer per run: a driver holds its run's lease; a second driver of the run refuses in
one line naming the holder, and takes over only once the holder is gone (its process dead on
this host, or its heartbeat older than storage.lease_timeout_s)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time

import psutil
import pytest
from conftest import PRISTINE_ENV, S3_ENV
from drivers import Driver
from runs import ARGS, ROOT, assert_same_run, final_state, fs_for, wait_for

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
    from storage.runs import delete_run

    cfg = StorageConfig(root=str(tmp_path / "runs"))
    store = RunStore(cfg, "r1")
    store.write_run({"created": time.time()})
    with RunLease(store, timeout_s=60), pytest.raises(LeaseHeld, match="stop it before deleting"):
        delete_run(cfg, "r1")
