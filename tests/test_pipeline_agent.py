"""Agent rollouts through the pipeline: each episode is committed as it ends, so a driver
killed in the middle of the rollout stage resumes with those episodes reused byte for byte
and runs only the others (real driver processes, SIGKILL, real Prefect API). And the agent
tests that train or wait by design (outside the fast tier): a call's own temperature through
the update, a slow backend, an agent blocking its event loop."""

from __future__ import annotations

import json
import signal
import time

import torch
from run_driver import ARGS, STEPS, driver, fs_for
from safetensors.torch import load as st_load
from test_agent import Log, engine_for, rows_of

from hybrid_engine.batch import Batch

AGENT = [*ARGS, "rollout.agent.function=agent_fns:answer_then_revise"]
KILLED_AFTER = 6  # episodes committed when the driver dies


def episode_files(fs, run: str, step: int) -> dict[str, bytes]:
    out = {}
    for d in fs.ls(f"{run}/steps/{step}", detail=False):
        name = d.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("rollout-episode") and fs.exists(f"{d}/COMMITTED"):
            for f in fs.ls(d, detail=False):
                out[f"{name}/{f.rsplit('/', 1)[-1]}"] = fs.cat_file(f)
    return out


def test_killed_mid_rollout_resumes_with_committed_episodes_reused(tmp_path, prefect_api):
    root = str(tmp_path)
    fs, run = fs_for(root, None), f"{root}/agent"
    train = ["train", "configs/grpo_tiny.yaml", *AGENT, f"storage.root={root}", "--run-id", "agent"]
    rc, out = driver(train, prefect_api, fault=f"step-2/rollout:episode-{KILLED_AFTER}=kill")
    assert rc == -signal.SIGKILL, out
    assert not fs.exists(f"{run}/steps/2/rollout/COMMITTED")
    before = episode_files(fs, run, 2)
    kept = {k.split("/")[0] for k in before}
    assert len(kept) == KILLED_AFTER, sorted(kept)
    rc, out = driver(["resume", "agent", f"storage.root={root}"], prefect_api)
    assert rc == 0, out
    after = episode_files(fs, run, 2)
    assert all(after[k] == v for k, v in before.items()), "a committed episode was redone"
    assert len({k.split("/")[0] for k in after}) == 16
    # the step's batch holds the kept episodes' recorded tokens
    batch = st_load(fs.cat_file(f"{run}/steps/2/rollout/batch.safetensors"))
    fields = json.loads(fs.cat_file(f"{run}/steps/2/rollout/batch.json"))["non_tensors"]
    for name in kept:
        i = int(name.removeprefix("rollout-episode"))
        ep = json.loads(before[f"{name}/meta.json"])["episode"]
        (j,) = [j for j, e in enumerate(fields["episode"]) if e == i]
        ids = batch["response_ids"][j][batch["response_mask"][j].bool()].tolist()
        assert ids == [t for c in ep["calls"] for t in c["choices"][0]["ids"]]
    summary = json.loads(fs.cat_file(f"{run}/final/summary.json"))
    rows = {h["step"]: h for h in summary["history"] if "agent/resumed" in h}
    assert rows[2]["agent/resumed"] == KILLED_AFTER and rows[1]["agent/resumed"] == 0
    assert len(rows) == STEPS and all(h["agent/calls/mean"] == 2 for h in rows.values())


def test_an_agent_blocking_the_event_loop_faults_the_episodes_it_stalls():
    engine, log = engine_for("blocks_loop", "rollout.agent.timeout_s=1"), Log()
    batch = engine.reward(engine.rollout(1, episode_log=log))
    assert sorted(log.saved) == list(range(16))  # every episode saved, the rollout returned
    blocked = [i for i in range(16) if batch["uid"][rows_of(batch, i)[0]].endswith("-0")]
    assert len(blocked) == 4
    assert all(batch["agent_fault"][rows_of(batch, i)[0]] == "timeout" for i in blocked)
    stalled = batch.meta["metrics"]["agent/faults/timeout"]
    assert 4 <= stalled == 16 * batch.meta["metrics"]["agent/fault_rate"]
    assert batch["scores"].tolist() == [0.0 if f else 1.0 for f in batch["agent_fault"]]


def test_time_queued_for_generation_is_not_the_agents(monkeypatch):
    """A backend slower than timeout_s: the agents' own code is quick, so nothing times out."""
    engine = engine_for("answer_then_revise", "rollout.agent.timeout_s=1")
    real = engine.actor.generate

    def slow(batch, sampling):
        time.sleep(1.5)
        return real(batch, sampling)

    monkeypatch.setattr(engine.actor, "generate", slow)
    batch = engine.rollout(1)
    assert batch.meta["metrics"]["agent/fault_rate"] == 0
    assert batch.meta["metrics"]["agent/calls/mean"] == 2


def test_an_agents_own_temperature_is_trained_at_it():
    """Calls at temperature 0.5 and 0 (greedy: log-probs of the model's own distribution,
    T=1) in a rollout at temperature 1: the training side's log-probs equal the rollout's."""
    engine = engine_for(
        "own_temperature",
        "algorithm.rollout_correction.level=token",
        "actor.ppo_mini_batch_size=16",
    )
    batch = engine.advantage(engine.reward(engine.rollout(1)))
    mask = batch["response_mask"].bool()
    gap = (batch["old_log_probs"] - batch["rollout_log_probs"])[mask].abs()
    assert float(gap.max()) < 1e-4
    assert batch.meta["metrics"]["rollout/logprob_gap_max"] == float(gap.max())  # logged
    temps = batch["response_temperature"][mask]
    assert set(temps.unique().tolist()) == {0.5, 1.0}  # 1.0: the greedy call's tokens
    # the update's log-probs (one mini-batch: before any optimizer step) equal the old ones
    m = engine.update(batch).meta["metrics"]
    assert abs(m["actor/ppo_kl"]) < 1e-6 and m["actor/pg_clipfrac"] == 0
    # a batch committed before the field existed: log-probs at rollout.temperature
    old = Batch({k: v for k, v in batch.tensors.items() if k != "response_temperature"})
    at_one = old.union(Batch({"response_temperature": torch.ones_like(mask, dtype=torch.float)}))
    assert torch.equal(
        engine.actor.compute_log_prob(old)["old_log_probs"],
        engine.actor.compute_log_prob(at_one)["old_log_probs"],
    )
