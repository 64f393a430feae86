"""Training runs sharing one pool (`ray.when_busy=share`), as users start them: `hybridrl
train` drivers started at the same moment on one `ray.pool_name` take turns stage by stage
and each ends with exactly the weights of the same run alone; `hybridrl pool status` lists
them; a driver killed while its stage holds the workers releases its turn, and the other
run finishes unchanged."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import PRISTINE_ENV
from drivers import Driver
from run_driver import ARGS, ROOT, driver, final_state, fs_for, own_ray_head, wait_for

POOL = ["trainer.backend=ray", "ray.call_timeout_s=120", "rollout.continuous_batching=false"]
SHARE = [*POOL, "ray.pool_name=shared", "ray.when_busy=share"]


@pytest.fixture(scope="module")
def env(tmp_path_factory, prefect_api):
    state = tmp_path_factory.mktemp("ray")
    with own_ray_head(state, "shared", prefect_api) as head:
        yield {
            **PRISTINE_ENV,
            **head,
            "PYTHONPATH": str(ROOT / "tests"),
            "PREFECT_API_URL": prefect_api,
        }
        for seed in (1, 2):  # the solo runs' pools; the fixture's `pool down` stops the head
            driver(["pool", "down", "--pool", f"solo{seed}"], prefect_api, extra_env=head)


def train(root, run: str, seed: int, *extra: str) -> list[str]:
    return [
        "train",
        "configs/grpo_tiny.yaml",
        *ARGS,
        f"trainer.seed={seed}",
        f"storage.root={root}",
        *extra,
        "--run-id",
        run,
    ]


@pytest.fixture(scope="module")
def solo(tmp_path_factory, env, prefect_api):
    """Each seed's run alone, on a pool of its own (its final weights); these pools keep the
    head up, so that the drivers started at once below find one head."""
    root = tmp_path_factory.mktemp("solo")
    out = {}
    for seed in (1, 2):
        args = train(root, f"solo{seed}", seed, *POOL, f"ray.pool_name=solo{seed}")
        rc, log = driver(args, prefect_api, extra_env=env, timeout=600)
        assert rc == 0, log
        out[seed] = final_state(fs_for(str(root), None), f"{root}/solo{seed}")[0]
    assert any(not torch.equal(out[1][k], out[2][k]) for k in out[1])  # the seeds differ
    return out


def assert_same_weights(got: dict, want: dict, run: str) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"run {run}: {k} differs from the run alone"


def status(env, prefect_api) -> str:
    rc, out = driver(["pool", "status", "--pool", "shared"], prefect_api, extra_env=env)
    return out


def test_two_runs_started_at_once_on_one_pool_each_end_as_they_would_alone(
    tmp_path, env, solo, prefect_api
):
    root = tmp_path / "runs"
    runs = {seed: Driver(train(root, f"shared{seed}", seed, *SHARE), env) for seed in (1, 2)}
    try:
        results = {seed: d.wait(timeout=600) for seed, d in runs.items()}
    finally:
        for d in runs.values():
            d.kill_group()
    for seed, (rc, out, _) in results.items():
        assert rc == 0, out
        assert "recovery" not in out
        weights, history = final_state(fs_for(str(root), None), f"{root}/shared{seed}")
        assert_same_weights(weights, solo[seed], f"shared{seed}")
        steps = [h for h in history if h["step"] > 0]
        assert all(h["timing_s/pool_switch"] >= 0 for h in steps), steps[0].keys()


def test_a_killed_driver_releases_its_turn_and_the_other_run_finishes(
    tmp_path, env, solo, prefect_api
):
    root, flag = tmp_path / "runs", tmp_path / "paused"
    # run one stops inside its advantage stage, holding the workers
    one = Driver(
        train(root, "one", 1, *SHARE),
        {**env, "HYBRIDRL_FAULT": f"step-2/advantage:start=pause:{flag}"},
    )
    two = None
    try:
        wait_for(flag, one)
        two = Driver(train(root, "two", 2, *SHARE), env)
        deadline = time.monotonic() + 300
        while "waiting" not in (shown := status(env, prefect_api)):
            assert two.poll() is None and time.monotonic() < deadline, shown
            time.sleep(1)
        assert "runs sharing pool 'shared'" in shown
        (holds,) = [line for line in shown.splitlines() if "holds the workers" in line]
        assert holds.startswith("  run one ") and "for step-2/advantage" in holds, shown
        (waits,) = [line for line in shown.splitlines() if "waiting" in line]
        assert waits.startswith("  run two "), shown
        rc, out = driver(["pool", "down", "--pool", "shared"], prefect_api, extra_env=env)
        assert rc == 1 and "is used by run one" in out and "stop that run first" in out
        one.kill_group()  # its process is gone: the scheduler detaches it at once
        rc, out, _ = two.wait(timeout=600)
    finally:
        one.kill_group()
        if two is not None:
            two.kill_group()
    assert rc == 0, out
    weights, _ = final_state(fs_for(str(root), None), f"{root}/two")
    assert_same_weights(weights, solo[2], "two")
    assert "runs sharing" not in status(env, prefect_api)  # both detached
