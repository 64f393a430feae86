"""The pool on a two-node Ray cluster on loopback: a head (`ray start --head`) and a second
node with its own raylet (`hybridrl cluster add-node`'s code), started and stopped here.

Ranks go where ray.placement and the custom resources ask; FSDP over ranks on two nodes
trains like the in-process loop; a local storage root is refused across nodes unless
declared shared; `hybridrl cluster status` shows the nodes and the workers on them; an
unplaceable pool is refused in one line naming what is missing.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
from conftest import PRISTINE_ENV
from drivers import Driver
from run_driver import driver, wait_for
from test_pool import SIGNAL, WAVES, cfg  # the pool tests' config for a named pool
from weights import assert_same_grad_norms, assert_same_weights

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.loop import train

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head (1 CPU) + node "second" (1 CPU, custom resource `second`) on 127.0.0.1; both
    stopped at the end, and none of their processes may survive."""
    from hybrid_engine.pool import cluster as ray_cluster

    old = os.environ.get("HYBRIDRL_RAY_STATE")
    os.environ["HYBRIDRL_RAY_STATE"] = str(tmp_path_factory.mktemp("raystate"))
    dirs = []
    try:  # stopped even when the second node fails to start
        # the head's GCS checks each node every 0.5 s and declares it dead after 3 misses
        # (Ray's defaults: 3 s and 5, ~15 s): a lost node is seen in seconds
        health = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3"}
        with patch.dict(os.environ, health):
            address = ray_cluster.local_head(start=True, num_cpus=1)
        dirs.append(json.loads((ray_cluster.state_dir() / "head.json").read_text())["temp_dir"])
        dirs.append(ray_cluster.add_local_node("second", 1, {"second": 1})["temp_dir"])
        yield {"address": address, "env": {"HYBRIDRL_RAY_STATE": os.environ["HYBRIDRL_RAY_STATE"]}}
    finally:
        ray_cluster.stop_local_head()
        left = [p.pid for d in dirs for p in ray_cluster.head_processes(d)]
        if old is None:
            os.environ.pop("HYBRIDRL_RAY_STATE")
        else:
            os.environ["HYBRIDRL_RAY_STATE"] = old
    assert not left, f"processes left behind: {left}"


def nodes_of(engine) -> dict[str, str]:
    return {w["name"]: w["node_id"] for w in engine.pool.status()}


def test_ranks_are_placed_on_the_nodes_asked_for(cluster):
    import ray

    pinned = Engine(cfg("pin", "ray.actor_resources={second: 1}"))
    head = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
    second = next(n["NodeID"] for n in ray.nodes() if "second" in n["Resources"])
    assert nodes_of(pinned) == {"actor-0": second}
    pinned.pool.down(stop_head=False)

    spread = Engine(cfg("spread", "actor.layout.dp=2", "ray.placement=strict_spread"))
    assert sorted(nodes_of(spread).values()) == sorted([head, second])
    shell = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # as a user's
    status = subprocess.run(
        [sys.executable, "-m", "flows.cli", "cluster", "status"],
        cwd=ROOT,
        env={**shell, **cluster["env"], "COLUMNS": "250"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    rows = {
        line.split("│")[1].strip(): line
        for line in status.stdout.splitlines()
        if line.count("│") > 3 and line.split("│")[1].strip() not in ("", "node")
    }
    assert set(rows) == {head[:12], second[:12]}, status.stdout
    assert "head" in rows[head[:12]] and "second=1" in rows[second[:12]]
    by_node = {v: k for k, v in nodes_of(spread).items()}
    assert f"spread/{by_node[second]}" in rows[second[:12]]
    spread.pool.down(stop_head=False)


def test_fsdp_across_two_nodes_trains_like_the_local_loop(cluster):
    local, local_hist = train(load_config("configs/grpo_tiny.yaml", [SIGNAL, *WAVES]))
    engine = Engine(cfg("x2", "actor.layout.dp=2", "ray.placement=strict_spread"))
    assert len(set(nodes_of(engine).values())) == 2
    _, hist = train(engine.cfg, engine=engine)
    # FSDP sums the gradients in another order (tests/test_pool.py: a few weights in a
    # million differ by a little more than 1e-6)
    assert_same_weights(engine.actor.full_state_dict(), local.actor.policy.state_dict(), 1e-5)
    assert_same_grad_norms(hist, local_hist, "actor")
    assert [h["critic/score/mean"] for h in hist] == [h["critic/score/mean"] for h in local_hist]
    assert hist[-1]["timing_s/reshard"] > 0
    engine.pool.down(stop_head=False)


def test_an_unplaceable_pool_is_refused_in_one_line(cluster):
    from hybrid_engine.pool.pool import PoolError, find_workers

    with pytest.raises(PoolError, match=r"no alive node has gpu_box=1"):
        Engine(cfg("nogpu", "ray.actor_resources={gpu_box: 1}"))
    with pytest.raises(PoolError, match=r"strict_spread needs 4 nodes that each fit one; 2 do"):
        Engine(
            cfg(
                "four",
                "actor.layout.dp=4",
                "ray.placement=strict_spread",
                "actor.ppo_micro_batch_size=2",
            )
        )
    assert not find_workers("nogpu") and not find_workers("four")


def test_local_storage_is_refused_across_nodes_unless_shared(cluster, tmp_path, prefect_api):
    from storage.store import check_reach

    base = [
        "trainer.backend=ray",
        "ray.pool_name=store",
        "actor.layout.dp=2",
        "ray.placement=strict_spread",
        "trainer.total_training_steps=1",
        "tracking.enabled=false",
        *WAVES,
        SIGNAL,
    ]
    run = ["train", "configs/grpo_tiny.yaml", *base]
    rc, out = driver(
        [*run, f"storage.root={tmp_path / 'runs'}", "--run-id", "r1"],
        prefect_api,
        extra_env=cluster["env"],
        timeout=300,
    )
    assert rc == 1, out
    assert "is a local directory but the pool and this driver are on 2 Ray nodes" in out
    shared = load_config(
        "configs/grpo_tiny.yaml",
        [f"storage.root={tmp_path / 'runs'}", "storage.shared_filesystem=true"],
    )
    check_reach(shared.storage, {"a", "b"})  # declared mounted on every node
    cfg_ = load_config("configs/grpo_tiny.yaml", ["storage.root=s3://bucket/x"])
    check_reach(cfg_.storage, {"a", "b"})  # an object store is seen by every node
    from hybrid_engine.pool.pool import connect, down

    connect(cfg("store"), start=False)
    import ray

    claim = ray.get_actor("claim", namespace="hybridrl-store")
    assert ray.get(claim.read.remote(), timeout=30) is None  # the refused run let go of it
    down("store", stop_head=False)


def test_a_lost_node_is_a_fault_the_run_recovers_from_or_refuses_in_one_line(
    cluster, tmp_path, prefect_api
):
    """A node "third" (2 CPUs) holds both FSDP ranks (pack); its raylet and workers are
    SIGKILLed in step 2: the recovery re-creates the pool on the head and "second" (one rank
    each) and the run ends with the weights of the run without a fault. A pool pinned to
    `third` loses its only node: the re-creation is refused in one line naming it."""
    from hybrid_engine.pool import cluster as ray_cluster

    base = [
        "trainer.backend=ray",
        "actor.layout.dp=2",
        "trainer.total_training_steps=2",
        "trainer.save_freq=1",
        "tracking.enabled=false",
        *WAVES,
        "pipeline.recovery_delay_s=0",
        f"storage.root={tmp_path}/runs",
        "storage.shared_filesystem=true",
        "ray.call_timeout_s=120",
        SIGNAL,
    ]
    env = {
        **PRISTINE_ENV,
        **cluster["env"],
        "PYTHONPATH": str(ROOT / "tests"),
        "PREFECT_API_URL": prefect_api,
    }

    def run_losing_third(run_id: str, *extra: str) -> subprocess.CompletedProcess:
        ray_cluster.add_local_node("third", 2, {"third": 2})
        flag = tmp_path / f"{run_id}.paused"
        args = ["train", "configs/grpo_tiny.yaml", *base, *extra, "--run-id", run_id]
        proc = Driver(args, {**env, "HYBRIDRL_FAULT": f"step-2/reward:start=pause:{flag}"})
        try:
            wait_for(flag, proc)
            assert ray_cluster.remove_local_node("third", kill=True)  # the machine is gone
            flag.unlink()
            rc, out, _ = proc.wait(timeout=400)
        finally:
            proc.kill_group()
            ray_cluster.remove_local_node("third", kill=True)
        return subprocess.CompletedProcess(args, rc, out)

    moved = run_losing_third("moved", "ray.pool_name=moved", "ray.placement=pack")
    assert moved.returncode == 0, moved.stdout
    assert "recovery 1/" in moved.stdout and "pool 'moved' re-created" in moved.stdout
    ref, _ = train(
        load_config(
            "configs/grpo_tiny.yaml",
            [SIGNAL, "trainer.total_training_steps=2", *WAVES],
        )
    )
    from safetensors.torch import load_file

    final = load_file(tmp_path / "runs/moved/final/model.safetensors")
    expect = ref.actor.policy.state_dict()  # final/ leaves out the tied lm_head
    assert_same_weights(final, {k: expect[k] for k in final}, 1e-5)  # 2 FSDP ranks: as above

    pinned = run_losing_third("pinned", "ray.pool_name=pinned", "ray.actor_resources={third: 1}")
    assert pinned.returncode == 1, pinned.stdout
    line = next(x for x in pinned.stdout.splitlines() if x.startswith("error:"))
    assert "no alive node has third=1" in line, pinned.stdout
    import ray

    from hybrid_engine.pool.pool import connect, down, pool_status

    connect(cfg("moved"), start=False)
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}  # the head and "second"
    assert len(alive) == 2 and {w["node_id"] for w in pool_status("moved")} == alive
    down("moved", stop_head=False)
    down("pinned", stop_head=False)
