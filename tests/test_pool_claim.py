"""One run per pool: a run claims its pool; a second run on a busy pool refuses in one line
naming the run that holds it (or waits, with ray.when_busy=wait), and the running run goes
on undisturbed; the claim of a driver that died on this host is taken over at once."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import PRISTINE_ENV
from drivers import Driver
from runs import ARGS, ROOT, driver, own_ray_head, wait_for

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
