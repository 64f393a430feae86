"""One run per pool: a run claims its pool; a second run on a busy pool refuses in one line
naming the run that holds it (or waits, with ray.when_busy=wait), and the running run goes
on undisturbed; the claim of a driver that died on this host is taken over at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import PRISTINE_ENV
from drivers import Driver
from run_driver import ARGS, ROOT, driver, own_ray_head, wait_for

HOLD = """
import sys, time
from hybrid_engine.config import load_config
from hybrid_engine.pool.claim import claim_pool
cfg = load_config("configs/grpo_tiny.yaml", ["trainer.backend=ray", "ray.pool_name=claimed",
                                             "trainer.run_id=holder"])
claim = claim_pool(cfg)
print("held", flush=True)
time.sleep(float(sys.argv[1]))
claim.release()
print("released", flush=True)
time.sleep(600)
"""


# a claimer whose clock runs an hour ahead of the claim actor's node (clock skew)
SKEWED = """
import time
real = time.time
time.time = lambda: real() + 3600
from hybrid_engine.config import load_config
from hybrid_engine.pool.claim import PoolBusy, claim_pool
cfg = load_config("configs/grpo_tiny.yaml", ["trainer.backend=ray", "ray.pool_name=claimed",
                                             "trainer.run_id=skewed"])
try:
    claim_pool(cfg).release()
    print("took it")
except PoolBusy as e:
    print("refused:", e)
import ray
from ray._private import state
(actor,) = [a for a in state.actors().values() if a["Name"] == "claim"]
(head,) = [n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"]]
print("on the head:", actor["Address"]["NodeID"] == head)
"""


@pytest.fixture
def head(tmp_path, prefect_api):
    with own_ray_head(tmp_path / "ray", "claimed", prefect_api) as env:
        yield {**PRISTINE_ENV, **env, "PYTHONPATH": str(ROOT)}


def holder(env: dict, seconds: float) -> subprocess.Popen:
    """Another process that holds pool 'claimed' for `seconds`, then releases it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(seconds)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def claim(env: dict, *extra: str) -> subprocess.CompletedProcess:
    code = (
        "from hybrid_engine.config import load_config\n"
        "from hybrid_engine.pool.claim import claim_pool\n"
        "import sys\n"
        "cfg = load_config('configs/grpo_tiny.yaml', ['trainer.backend=ray', "
        "'ray.pool_name=claimed', 'trainer.run_id=second', *sys.argv[1:]])\n"
        "claim_pool(cfg, say=print).release()\n"
        "print('claimed')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_busy_pool_refuses_or_waits_and_a_dead_holder_is_taken_over_at_once(head):
    first = holder(head, 600)
    try:
        refused = claim(head)
        assert refused.returncode == 1 and "claimed" not in refused.stdout
        last = refused.stderr.strip().splitlines()[-1]
        assert "PoolBusy: pool 'claimed' is used by run holder" in last
        assert f"pid {first.pid}" in last and "ray.when_busy=wait" in last
        first.kill()  # its driver is gone: no waiting for a timeout
        first.wait(timeout=30)
        assert claim(head).stdout.strip().endswith("claimed")
    finally:
        first.kill()
    second = holder(head, 20)  # longer than the waiter takes to start and connect
    try:
        start = time.monotonic()
        waited = claim(head, "ray.when_busy=wait")
        assert waited.returncode == 0, waited.stderr
        assert time.monotonic() - start >= 19
        assert "used by run holder" in waited.stdout and "waiting for it" in waited.stdout
    finally:
        second.kill()


def test_a_second_run_on_a_busy_pool_refuses_and_the_first_finishes(tmp_path, head, prefect_api):
    root, flag = tmp_path / "runs", tmp_path / "paused"
    env = {**head, "PYTHONPATH": str(ROOT / "tests"), "PREFECT_API_URL": prefect_api}
    pool = ["trainer.backend=ray", "ray.pool_name=claimed", "ray.call_timeout_s=120"]
    args = ["train", "configs/grpo_tiny.yaml", *ARGS, *pool, f"storage.root={root}"]
    first = Driver(
        [*args, "--run-id", "one"], {**env, "HYBRIDRL_FAULT": f"step-2/reward:start=pause:{flag}"}
    )
    try:
        wait_for(flag, first)
        rc, out = driver([*args, "--run-id", "two"], prefect_api, extra_env=env, timeout=300)
        assert rc == 1, out
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "pool 'claimed' is used by run one" in errors[0], out
        rc, out = driver(["pool", "down", "--pool", "claimed"], prefect_api, extra_env=env)
        assert rc == 1 and "is used by run one" in out and "stop that run first" in out
        flag.unlink()
        rc, out, _ = first.wait(timeout=400)
    finally:
        first.kill_group()
    assert rc == 0, out
    assert "recovery" not in out  # nothing disturbed it


def test_the_claim_ages_on_its_own_clock_lives_on_the_head_and_ctrl_c_frees_it(
    tmp_path, head, prefect_api
):
    """A live holder is not taken over by a driver whose clock runs an hour ahead (the age
    is the claim actor's own); the claim asks for the head node (a driver's node may die
    with its driver); a driver stopped by Ctrl-C (SIGINT) releases its run's lease and
    the pool's claim (the next claimer finds it free, no takeover)."""
    from hybrid_engine.config import StorageConfig
    from storage.lease import RunLease
    from storage.store import RunStore

    first = holder(head, 600)
    try:
        p = subprocess.run(
            [sys.executable, "-c", SKEWED],
            cwd=ROOT,
            env=head,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        assert "refused: pool 'claimed' is used by run holder" in p.stdout, p.stdout + p.stderr
        assert "on the head: True" in p.stdout, p.stdout
    finally:
        first.kill()
        first.wait(timeout=30)
    root, flag = tmp_path / "runs", tmp_path / "paused"
    env = {**head, "PYTHONPATH": str(ROOT / "tests"), "PREFECT_API_URL": prefect_api}
    args = ["train", "configs/grpo_tiny.yaml", *ARGS, "trainer.backend=ray"]
    args += ["ray.pool_name=claimed", f"storage.root={root}", "--run-id", "ctrl-c"]
    run = Driver(args, {**env, "HYBRIDRL_FAULT": f"step-1/rollout:start=pause:{flag}"})
    try:
        wait_for(flag, run)
        os.kill(run.pid, signal.SIGINT)
        time.sleep(2)
        flag.unlink()
        rc, out, _ = run.wait(timeout=300)
    finally:
        run.kill_group()
    assert rc != 0, out
    lease = RunLease(RunStore(StorageConfig(root=str(root)), "ctrl-c"), 60)
    assert lease.holder()[1]["released"], out
    taken = claim(head)
    assert taken.returncode == 0, taken.stderr
    assert "taken over" not in taken.stderr, taken.stderr
