"""The persistent Ray pool on a real local head (started and stopped by these tests).

FSDP2 over 2 ranks must train exactly like 1 rank and like the in-process loop; a second
driver re-attaches to the same workers; state saves and loads across layouts; a dead worker is
named; a pool built for another config is refused; no process is left behind.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file
from weights import assert_same_grad_norms, assert_same_weights

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.loop import train

SIGNAL = "reward.function=reward_fns:length_score"
# Rollouts split over ranks sample what one rank samples when every rank decodes the same
# batches of rows: 8 at a time, queued rows waiting for the batch to empty.
WAVES = ["rollout.micro_batch_size=8", "rollout.continuous_batching=false"]


def cfg(pool: str, *extra: str):
    return load_config(
        "configs/grpo_tiny.yaml",
        [
            SIGNAL,
            "trainer.backend=ray",
            f"ray.pool_name={pool}",
            *WAVES,
            "ray.call_timeout_s=120",
            *extra,
        ],
    )


HEADS: set[str] = set()  # temp dirs of the heads these tests ran on


@pytest.fixture(scope="module", autouse=True)
def ray_head(tmp_path_factory):
    """A head of our own (its own state dir), stopped at the end; nothing may survive it."""
    from hybrid_engine.pool import pool

    old = os.environ.get("HYBRIDRL_RAY_STATE")
    os.environ["HYBRIDRL_RAY_STATE"] = str(tmp_path_factory.mktemp("raystate"))
    yield
    pool.stop_local_head()
    left = [p.pid for d in HEADS for p in pool.head_processes(d)]
    assert HEADS and not left, f"processes left behind: {left}"
    if old is None:
        os.environ.pop("HYBRIDRL_RAY_STATE")
    else:
        os.environ["HYBRIDRL_RAY_STATE"] = old


@pytest.fixture(autouse=True)
def note_head():
    from hybrid_engine.pool import pool

    yield
    state = pool.state_dir() / "head.json"
    if state.is_file():
        HEADS.add(json.loads(state.read_text())["temp_dir"])


def test_two_fsdp_ranks_train_like_one_rank_and_like_the_local_loop():
    local, local_hist = train(load_config("configs/grpo_tiny.yaml", [SIGNAL, *WAVES]))
    expected = local.actor.policy.state_dict()
    for dp in (1, 2):
        engine = Engine(cfg(f"eq{dp}", f"actor.layout.dp={dp}"))
        _, hist = train(engine.cfg, engine=engine)
        # 2 ranks sum the gradients in another order: a few weights in a million differ by
        # a little more than 1e-6 (measured: 2 of 6.4M, by 1.3e-6)
        assert_same_weights(engine.actor.full_state_dict(), expected, None if dp == 1 else 1e-5)
        assert_same_grad_norms(hist, local_hist, "actor")
        assert [h["critic/score/mean"] for h in hist] == [
            h["critic/score/mean"] for h in local_hist
        ]
        # the held-out set has 3 rows: at 2 ranks it is padded to 4 and unpadded on gather
        for key in ("val/accuracy", "val/score/mean", "val/response_length/mean"):
            assert hist[-1][key] == local_hist[-1][key], key
        info = engine.pool.status()
        assert [w["name"] for w in info] == [f"actor-{r}" for r in range(dp)]
        # a single rank keeps freed memory like the local backend; FSDP ranks do not
        for w in info:
            environ = Path(f"/proc/{w['pid']}/environ").read_bytes().split(b"\0")
            assert (b"MALLOC_MMAP_MAX_=0" in environ) == (dp == 1), (dp, w["name"])
            assert b"MALLOC_MMAP_THRESHOLD_=4194304" in environ  # ray.worker_env's default
        assert all(w["weights_version"] == 2 and w["healthy"] for w in info)
        total = sum(p.numel() for p in expected.values()) - expected["lm_head.weight"].numel()
        assert sum(w["actor"]["local_params"] for w in info) == total  # shards, no overlap
        assert all(w["actor"]["sharded"] == (dp == 2) for w in info)
        if dp == 2:
            assert hist[-1]["timing_s/reshard"] > 0  # full weights were gathered for rollout
        engine.pool.down(stop_head=False)


def test_second_driver_reattaches_to_the_same_workers_and_weights(tmp_path):
    engine = Engine(cfg("attach"))
    engine.step(1)
    pid = engine.pool.status()[0]["pid"]
    script = (
        "import json, sys; sys.path.insert(0, 'tests')\n"
        "from hybrid_engine.pool.pool import Pool\n"
        "from test_pool import cfg\n"
        "p = Pool.up(cfg('attach'))\n"
        "w = p.status()[0]\n"
        "print(json.dumps({'created': p.created, 'attach_s': p.attach_seconds, "
        "'version': w['weights_version'], 'pid': w['pid']}))\n"
    )
    from hybrid_engine.pool import pool

    # the second driver finds the cluster through RAY_ADDRESS, as on an existing cluster
    address = json.loads((pool.state_dir() / "head.json").read_text())["address"]
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "RAY_ADDRESS": address, "HYBRIDRL_RAY_STATE": "/nonexistent"},
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["created"] is False and seen["version"] == 1 and seen["pid"] == pid
    assert seen["attach_s"] < 5  # measured ~0.3 s; the bound only catches a silent re-create
    from hybrid_engine.pool.claim import PoolTaken

    # that driver configured the workers: this one's next call is refused in one line
    taken = r"pool 'attach': worker actor-0 was configured by run .* \(pid \d+ on .*\) while run"
    with pytest.raises(PoolTaken, match=taken):
        _ = engine.actor.weights_version
    with pytest.raises(PoolTaken, match=taken):
        engine.step(2)

    status = subprocess.run(
        [sys.executable, "-m", "flows.cli", "pool", "status", "--pool", "attach"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    assert "actor-0" in status.stdout and str(pid) in status.stdout and "ok" in status.stdout

    from hybrid_engine.pool.pool import PoolError

    with pytest.raises(PoolError, match="built for another config.*model"):
        Engine(cfg("attach", "model.tiny.hidden_size=32"))
    with pytest.raises(PoolError, match="needs"):
        Engine(cfg("attach", "actor.layout.dp=2"))
    # a new run on the warm pool starts from fresh weights
    fresh = Engine(cfg("attach"))
    assert fresh.actor.weights_version == 0 and fresh.pool.status()[0]["pid"] == pid
    # an older client configures the workers without a driver id: refused, not a KeyError
    import ray

    handle = fresh.pool.groups["actor"].handles[0]
    ray.get(handle.configure.remote(cfg("attach")), timeout=60)
    with pytest.raises(PoolTaken, match="by a driver that does not claim pools"):
        _ = fresh.actor.weights_version
    with pytest.raises(PoolTaken, match="by a driver that does not claim pools"):
        fresh.actor.invalidate()
    assert fresh.pool.status()[0]["healthy"]
    # a driver running other engine code (here: one file edited) is refused in one line
    other = tmp_path / "other"
    shutil.copytree(
        "hybrid_engine", other / "hybrid_engine", ignore=shutil.ignore_patterns("*.pyc")
    )
    with open(other / "hybrid_engine" / "engine.py", "a") as f:
        f.write("# edited\n")
    script = (
        f"import sys; sys.path[:0] = [{str(other)!r}, 'tests']\n"
        "import hybrid_engine\n"
        f"assert hybrid_engine.__file__.startswith({str(other)!r}), hybrid_engine.__file__\n"
        "from hybrid_engine.pool.pool import Pool\n"
        "from test_pool import cfg\n"
        "Pool.up(cfg('attach'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_ADDRESS": address, "HYBRIDRL_RAY_STATE": "/nonexistent"},
    )
    assert out.returncode != 0
    assert re.search(
        r"PoolError: pool 'attach' was started by other hybridrl code \(pool runs [0-9a-f]{12}, "
        r"this is [0-9a-f]{12}\): `hybridrl pool down --pool attach` and start again",
        out.stderr.splitlines()[-1],
    ), out.stderr[-2000:]
    assert fresh.pool.status()[0]["healthy"]
    fresh.pool.down(stop_head=False)


def test_a_driver_that_imported_ray_first_is_told_so():
    # ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, on import: such a driver looked for
    # the local head on the host address and waited there for minutes
    script = (
        "import ray, sys; sys.path.insert(0, 'tests')\n"
        "from test_pool import cfg\n"
        "from hybrid_engine.pool.cluster import connect\n"
        "connect(cfg('early'))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode != 0
    assert "ray was imported before hybrid_engine" in out.stderr.splitlines()[-1]


def test_state_round_trip_resumes_exactly_and_across_layouts(tmp_path):
    two = Engine(cfg("state2", "actor.layout.dp=2"))
    two.step(1)
    files = two.actor.save(str(tmp_path / "a"))
    assert {os.path.basename(f) for f in files} >= {
        "model.safetensors",
        "optim.safetensors",
        "state.json",
        "rng_rank0.safetensors",
        "rng_rank1.safetensors",
    }
    two.step(2)
    uninterrupted = two.actor.full_state_dict()
    assert two.actor.load(str(tmp_path / "a")) == 1
    # a state loaded into FSDP ranks saves back to the same bytes (torch's
    # get_optimizer_state_dict once gathered exp_avg into exp_avg_sq here)
    two.actor.save(str(tmp_path / "b"))
    for name in ("optim.safetensors", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    two.step(2)
    assert_same_weights(two.actor.full_state_dict(), uninterrupted)  # optimizer state restored

    one = Engine(cfg("state1"))
    assert one.actor.load(str(tmp_path / "a")) == 1  # saved by 2 ranks, loaded by 1
    saved = load_file(tmp_path / "a" / "model.safetensors")
    got = one.actor.full_state_dict()
    assert_same_weights({k: got[k] for k in saved}, saved)
    one.step(2)
    assert_same_weights(one.actor.full_state_dict(), uninterrupted)
    two.pool.down(stop_head=False)
    one.pool.down(stop_head=False)


def test_dead_worker_is_named_and_the_pool_is_rebuilt_from_saved_state(tmp_path):
    from hybrid_engine.errors import WorkerDiedError

    engine = Engine(cfg("dead", "actor.layout.dp=2"))
    engine.step(1)
    engine.actor.save(str(tmp_path / "s"))
    victim = next(w for w in engine.pool.status() if w["name"] == "actor-1")
    psutil.Process(victim["pid"]).kill()  # kill -9
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"actor-1 \(pid {victim['pid']}\)"):
        engine.rollout(2)
    assert time.monotonic() - start < 60
    status = {w["name"]: w["healthy"] for w in engine.pool.status()}
    assert status.get("actor-1") is not True
    engine.pool.down(stop_head=False)

    rebuilt = Engine(cfg("dead", "actor.layout.dp=2"))
    assert rebuilt.pool.created
    assert rebuilt.actor.load(str(tmp_path / "s")) == 1
    saved = load_file(tmp_path / "s" / "model.safetensors")
    got = rebuilt.actor.full_state_dict()
    assert_same_weights({k: got[k] for k in saved}, saved)
    assert rebuilt.step(2)["weights_version"] == 2
    rebuilt.pool.down(stop_head=False)


def test_ppo_with_separate_critic_and_reward_model_groups_matches_the_local_loop():
    """Actor FSDP over 2 ranks, critic FSDP over its own 2 ranks, reward model on its own."""
    base = [
        "reward.model_path=tiny",
        "rollout.micro_batch_size=2",
        "rollout.continuous_batching=false",
    ]
    local, local_hist = train(load_config("configs/ppo_tiny.yaml", base))
    engine = Engine(
        load_config(
            "configs/ppo_tiny.yaml",
            [
                *base,
                "trainer.backend=ray",
                "ray.pool_name=ppo",
                "actor.layout.dp=2",
                "ray.critic=separate",
                "ray.critic_dp=2",
                "ray.reward_model=separate",
            ],
        )
    )
    _, hist = train(engine.cfg, engine=engine)
    names = {w["name"]: w["roles"] for w in engine.pool.status()}
    assert names == {
        "actor-0": ["actor"],
        "actor-1": ["actor"],
        "critic-0": ["critic"],
        "critic-1": ["critic"],
        "rm-0": ["rm"],
    }
    # FSDP sums the ranks' gradients in another order than one process does. Adam divides each
    # gradient by its own running size, so where a gradient is near 0 that rounding becomes a
    # visible part of a step. Measured: 60 of the actor's 6.4M weights beyond 1e-6, the largest
    # 3.7e-5 (one o_proj weight). The bound for those is 10% of one step (lr = 1e-3); a real
    # divergence (a wrong gradient scale, a missed rank) moves most weights by about a step.
    step = 1e-3
    assert_same_weights(engine.actor.full_state_dict(), local.actor.policy.state_dict(), step / 10)
    assert_same_weights(engine.critic.full_state_dict(), local.critic.model.state_dict(), step / 10)
    assert_same_grad_norms(hist, local_hist, "actor", "critic")
    assert all(torch.isfinite(torch.tensor(h["critic/vf_loss"])) for h in hist)
    engine.pool.down(stop_head=False)


def test_lora_with_kl_and_rollout_correction_on_one_and_two_ranks_matches_local(tmp_path):
    """LoRA on FSDP: adapters train on both ranks, the base (adapters off) is the reference,
    IS weights reach the workers; an adapter-only checkpoint of 2 ranks loads into 1."""
    extra = [
        "actor.lora.rank=4",
        "actor.lora.alpha=8",
        "actor.use_kl_loss=true",
        "algorithm.rollout_correction.level=token",
    ]
    local, local_hist = train(load_config("configs/grpo_tiny.yaml", [SIGNAL, *WAVES, *extra]))
    expected = local.actor.policy.state_dict()
    for dp in (1, 2):
        engine = Engine(cfg(f"lora{dp}", f"actor.layout.dp={dp}", *extra))
        _, hist = train(engine.cfg, engine=engine)
        assert_same_weights(engine.actor.full_state_dict(), expected, 1e-4)
        assert_same_grad_norms(hist, local_hist, "actor")
        assert all(torch.isfinite(torch.tensor(h["actor/kl_loss"])) for h in hist if h["step"])
        if dp == 2:
            files = engine.actor.save(str(tmp_path / "lora"))
            saved = load_file(tmp_path / "lora" / "model.safetensors")
            assert files and all(".lora_" in k for k in saved)
        engine.pool.down(stop_head=False)
    one = Engine(cfg("lora1", *extra))
    assert one.actor.load(str(tmp_path / "lora")) == 2
    assert_same_weights(one.actor.full_state_dict(), expected, 1e-4)
    one.pool.down(stop_head=False)


def test_multi_turn_rollouts_on_two_ranks_match_the_local_loop():
    """The turn loop runs in the driver; each turn's batched generate is split over the
    ranks: two FSDP ranks give the local loop's trajectories and weights."""
    extra = [
        "rollout.multi_turn.enabled=true",
        "rollout.multi_turn.environment=env_fns:TwoTurns",
        "rollout.multi_turn.max_total_tokens=96",
    ]
    local, local_hist = train(load_config("configs/grpo_tiny.yaml", [SIGNAL, *WAVES, *extra]))
    engine = Engine(cfg("mt2", "actor.layout.dp=2", *extra))
    _, hist = train(engine.cfg, engine=engine)
    assert_same_weights(engine.actor.full_state_dict(), local.actor.policy.state_dict(), 1e-4)
    assert_same_grad_norms(hist, local_hist, "actor")
    for h, h_local in zip(hist[1:], local_hist[1:], strict=True):
        assert h["multi_turn/turns/mean"] == 2.0
        assert h["critic/score/mean"] == pytest.approx(h_local["critic/score/mean"], abs=1e-6)
    engine.pool.down(stop_head=False)


def test_agent_episodes_on_two_ranks_match_the_local_loop():
    """The endpoint runs in the driver and batches the agents' calls into the pool's
    generate; a varying number of sequences (faulted episodes dropped) fills the last
    mini-batch with untrained rows: two ranks give the local loop's weights."""
    extra = ["rollout.agent.function=agent_fns:picky", "rollout.agent.on_fault=drop"]
    local, local_hist = train(load_config("configs/grpo_tiny.yaml", [SIGNAL, *WAVES, *extra]))
    engine = Engine(cfg("agent2", "actor.layout.dp=2", *extra))
    _, hist = train(engine.cfg, engine=engine)
    assert_same_weights(engine.actor.full_state_dict(), local.actor.policy.state_dict(), 1e-4)
    for h, h_local in zip(hist[1:], local_hist[1:], strict=True):
        assert h["agent/dropped"] == h_local["agent/dropped"]
        assert h["agent/sequences"] == h_local["agent/sequences"]
    assert any(h["agent/sequences"] % 8 for h in hist[1:])  # a mini-batch was filled up
    engine.pool.down(stop_head=False)
