"""Driver processes for the pipeline tests: a `hybridrl` command in its own process group,
its final state, and the comparison with the uninterrupted run (the `reference` fixture of
conftest.py)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import fsspec
import torch
from conftest import PRISTINE_ENV, S3_ENV
from drivers import Driver
from safetensors.torch import load as st_load

ROOT = Path(__file__).parents[1]
STEPS = 4
ARGS = [
    "reward.function=reward_fns:length_score",
    f"trainer.total_training_steps={STEPS}",
    "trainer.save_freq=2",
    "trainer.test_freq=2",
    "trainer.val_before_train=true",
    "rollout.micro_batch_size=8",
    "pipeline.retry_delay_s=0.2",
    "tracking.enabled=false",
]
KILLS = [
    "step-1/rollout:before_commit",
    "step-2/reward:before_commit",
    "step-2:end",
    "step-3/advantage:before_commit",
    "step-4/update:before_commit",
]


def wait_for(flag: Path, proc: Driver, timeout_s: float = 300) -> None:
    """Until `flag` exists (a `pause:` fault point was reached); fails with the process's
    output if it ends first or the time runs out (then the process group is killed)."""
    deadline = time.monotonic() + timeout_s
    while not flag.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill_group()
            rc, out, _ = proc.wait(timeout=30)
            raise AssertionError(f"{flag.name} not reached (exit {rc}):\n{out}")
        time.sleep(0.05)


def driver(
    args: list[str],
    prefect_api: str,
    fault: str | None = None,
    extra_env=None,
    timeout: float = 600,
):
    """One `hybridrl` process in its own process group (killed with it if it crashes):
    (exit status, stdout and stderr interleaved)."""
    env = {
        **PRISTINE_ENV,
        **S3_ENV,
        "PYTHONPATH": str(ROOT / "tests"),
        "PREFECT_API_URL": prefect_api,
        **(extra_env or {}),
    }
    env.pop("HYBRIDRL_FAULT", None)
    if fault:
        env["HYBRIDRL_FAULT"] = fault
    proc = Driver(args, env)  # forked from a process that has imported the stack already
    rc, out, _ = proc.wait(timeout=timeout)
    if rc < 0:  # a crash: nothing of it may survive
        proc.kill_group()
    return rc, out


@contextlib.contextmanager
def own_ray_head(state: Path, pool_name: str, prefect_api: str):
    """A pool on its own local head (state dir `state`): yields the drivers' environment;
    afterwards `pool down`, and nothing of the head may be left running."""
    from hybrid_engine.pool import pool

    env = {"HYBRIDRL_RAY_STATE": str(state)}
    yield env
    head = state / "head.json"
    if head.is_file():
        temp_dir = json.loads(head.read_text())["temp_dir"]
        driver(["pool", "down", "--pool", pool_name], prefect_api, extra_env=env, timeout=120)
        assert not pool.head_processes(temp_dir), "the local Ray head outlived the test"


def fs_for(root: str, endpoint: str | None):
    opts = {"endpoint_url": endpoint} if root.startswith("s3://") else {}
    return fsspec.core.url_to_fs(root, **opts)[0]


def final_state(fs, run_url: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
    weights = st_load(fs.cat_file(f"{run_url}/final/model.safetensors"))
    summary = json.loads(fs.cat_file(f"{run_url}/final/summary.json"))
    return weights, summary["history"]


def comparable(history: list[dict]) -> list[dict]:
    """Metrics that must be equal: everything but wall times and speeds."""
    return [
        {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/"))}
        for row in history
    ]


def rollout_markers(fs, run_url: str) -> dict[str, bytes]:
    out = {}
    for step in range(1, STEPS + 1):
        path = f"{run_url}/steps/{step}/rollout"
        if fs.exists(f"{path}/COMMITTED"):
            out[path] = fs.cat_file(f"{path}/COMMITTED") + fs.cat_file(f"{path}/batch.safetensors")
    return out


def assert_same_run(got, reference) -> None:
    (w, hist), (w_ref, hist_ref) = got, reference
    assert w.keys() == w_ref.keys()
    for k in w_ref:
        assert torch.equal(w[k], w_ref[k]), f"{k} differs from the uninterrupted run"
    assert comparable(hist) == comparable(hist_ref)
    assert [r["step"] for r in hist] == list(range(STEPS + 1))
