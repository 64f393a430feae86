"""Runs sharing one pool (`ray.when_busy=share`) on a real local head, driven from this
process: each run has its own slot in the workers (weights, optimizer, RNG; two FSDP
ranks), so two runs of
different seeds whose steps interleave end with exactly the weights of each run alone; a
run is refused at attach for a must-match field, past ray.max_runs and past
ray.max_resident_gb (a run whose own state passes it; another bound than the pool's); a run
that detaches frees its slot. Past the bound, parked slots are offloaded to disk and read
back at their turn, and the runs still end as they would alone."""

import json
import os
import threading

import pytest
import torch

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.pool.claim import PoolBusy
from hybrid_engine.pool.cluster import PoolError
from hybrid_engine.pool.sharing import claim_pool

BASE = [
    "reward.function=reward_fns:length_score",
    "trainer.backend=ray",
    "rollout.micro_batch_size=8",
    "rollout.continuous_batching=false",
    "actor.layout.dp=2",  # two FSDP ranks: each run's sharded model in its own slot
    "ray.call_timeout_s=120",
]


def cfg(pool: str, run: str, *extra: str):
    return load_config(
        "configs/grpo_tiny.yaml", [*BASE, f"ray.pool_name={pool}", f"trainer.run_id={run}", *extra]
    )


def shared(c) -> Engine:
    """An engine on a shared pool, attached as the train flow attaches it."""
    claim = claim_pool(c)
    try:
        with claim.turn("attach"):
            engine = Engine(c)
    except BaseException:
        claim.release()
        raise
    engine.pool.hold(claim)
    return engine


@pytest.fixture(scope="module", autouse=True)
def ray_head(tmp_path_factory):
    from hybrid_engine.pool import pool

    old = os.environ.get("HYBRIDRL_RAY_STATE")
    os.environ["HYBRIDRL_RAY_STATE"] = str(tmp_path_factory.mktemp("raystate"))
    yield
    state = pool.state_dir() / "head.json"
    temp_dir = json.loads(state.read_text())["temp_dir"] if state.is_file() else None
    pool.stop_local_head()
    assert temp_dir is None or not pool.head_processes(temp_dir), "the head outlived the tests"
    if old is None:
        os.environ.pop("HYBRIDRL_RAY_STATE")
    else:
        os.environ["HYBRIDRL_RAY_STATE"] = old


def test_two_runs_interleaved_on_one_pool_each_end_as_they_would_alone():
    solo = {}
    for seed in (1, 2):
        engine = Engine(cfg(f"solo{seed}", f"solo{seed}", f"trainer.seed={seed}"))
        for step in (1, 2):
            engine.step(step)
        solo[seed] = engine.actor.full_state_dict()
        engine.pool.down(stop_head=False)
    assert not torch.equal(solo[1]["lm_head.weight"], solo[2]["lm_head.weight"])

    share = ["ray.when_busy=share"]
    a = shared(cfg("sh", "a", "trainer.seed=1", *share))
    b = shared(cfg("sh", "b", "trainer.seed=2", "actor.optim.lr=1e-5", *share))
    b.pool.claim.release()  # another optimizer setting attaches too; detached, its slot is freed
    assert [r["run"] for r in a.pool.status()[0]["runs"]] == ["a"]
    b = shared(cfg("sh", "b", "trainer.seed=2", *share))
    for step in (1, 2):  # each call takes a turn: the workers swap slots at every one
        a.step(step)
        b.step(step)
    for engine, seed in ((a, 1), (b, 2)):
        got = engine.actor.full_state_dict()
        for k, v in solo[seed].items():
            assert torch.equal(got[k], v), f"seed {seed}: {k} differs from the run alone"
    workers = a.pool.status()
    assert [w["name"] for w in workers] == ["actor-0", "actor-1"]
    for worker in workers:
        runs = {r["run"]: r for r in worker["runs"]}
        assert set(runs) == {"a", "b"} and sum(r["active"] for r in runs.values()) == 1
        assert all(r["state_gb"] > 0 for r in runs.values())
    from hybrid_engine.pool.sharing import runs_on

    attached = runs_on("sh")["runs"]
    assert [r["run"] for r in attached] == ["a", "b"] and all(r["turns"] > 4 for r in attached)

    got = []  # a thread of the run (an agent episode) calls the pool within its stage's turn
    with a.pool.turn("step-3/rollout"):
        episode = threading.Thread(target=lambda: got.append(a.actor.weights_version))
        episode.start()
        episode.join(timeout=120)
    assert got == [2]

    # refusals at attach, one line each, naming the field
    with pytest.raises(PoolBusy, match="another model") as e:
        claim_pool(cfg("sh", "c", "model.tiny.hidden_size=32", *share))
    assert "\n" not in str(e.value)
    with pytest.raises(PoolBusy, match="ray.max_runs=2"):
        claim_pool(cfg("sh", "c", "ray.max_runs=2", *share))
    with pytest.raises(PoolBusy, match="shared by its runs"):  # a run alone waits or is refused
        claim_pool(cfg("sh", "c"))
    with pytest.raises(PoolBusy, match="another ray.max_resident_gb"):
        claim_pool(cfg("sh", "c", "ray.max_resident_gb=0.001", *share))
    size = max(r["state_gb"] for w in workers for r in w["runs"])
    a.pool.claim.release()
    b.pool.claim.release()
    assert a.pool.status()[0]["runs"] == [] and runs_on("sh")["runs"] == []
    alone = Engine(cfg("sh", "alone", "trainer.seed=1"))  # a run alone on the emptied pool
    alone.step(1)
    assert alone.actor.weights_version == 1
    alone.pool.down(stop_head=False)
    offloaded_runs(solo, size)


def offloaded_runs(solo: dict, size: float) -> None:
    """A bound that holds one run's state but not two: the parked run goes to disk."""
    from hybrid_engine.pool.cluster import state_dir

    with pytest.raises(PoolError, match=r"alone passes ray.max_resident_gb=1e-05"):
        shared(cfg("offload", "p", "ray.max_resident_gb=0.00001", "ray.when_busy=share"))
    share = ["ray.when_busy=share", f"ray.max_resident_gb={size * 1.5}"]
    a = shared(cfg("offload", "a", "trainer.seed=1", *share))
    b = shared(cfg("offload", "b", "trainer.seed=2", *share))
    disk = state_dir() / "offload" / "offload"
    for step in (1, 2):
        a.step(step)
        runs = {r["run"]: r for r in a.pool.status()[0]["runs"]}
        assert runs["a"]["active"] and runs["b"]["offloaded"] and not runs["a"]["offloaded"]
        assert len(list(disk.glob("actor-*/*.bin"))) == 2  # b's slot, in each FSDP rank
        b.step(step)
    from flows.cli.cluster import pool_status
    from flows.cli.runs import console

    with console.capture() as shown:
        pool_status("offload")
    assert "parked on disk in 2 worker(s)" in shown.get(), shown.get()  # a, parked last
    for engine, seed in ((a, 1), (b, 2)):
        got = engine.actor.full_state_dict()
        for k, v in solo[seed].items():
            assert torch.equal(got[k], v), f"seed {seed}, offloaded: {k} differs from alone"
    a.pool.claim.release()  # a parked run that leaves takes its file with it
    assert not list(disk.glob("actor-*/*.bin"))
    b.pool.claim.release()
    b.pool.down(stop_head=False)
    assert not disk.exists()
