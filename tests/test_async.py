"""Asynchronous training (`trainer.max_staleness`): the rollout of step N+1 runs beside the
update of step N, on weights the schedule fixes, and a run killed anywhere resumes exactly.

The pipeline tests run real driver processes (`hybridrl train` / `resume`, the Prefect flow
against a real Prefect API) on a real Ray pool with a separate rollout group, faults at named
points (`HYBRIDRL_FAULT`, storage/faults.py). The uninterrupted asynchronous run is the
reference: a run killed at each point of the overlap and resumed, and a run whose rollout
replica and trainer die mid-call, must end with its exact weights and metrics.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from run_driver import (
    ARGS,
    STEPS,
    assert_same_run,
    driver,
    final_state,
    fs_for,
    own_ray_head,
    rollout_markers,
)
from safetensors.torch import load_file

from hybrid_engine.config import ConfigError, load_config
from hybrid_engine.staleness import StaleSamples, rollout_version, staleness_metrics

ASYNC = [
    "trainer.max_staleness=1",
    "ray.pool_name=async",
    "ray.call_timeout_s=120",
    "pipeline.recovery_delay_s=0.2",
]


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("preset", sorted(p.name for p in Path("configs").glob("*.yaml")))
def test_max_staleness_alone_picks_what_it_needs_on_every_preset(preset):
    cfg = load_config(f"configs/{preset}", ["trainer.max_staleness=1"])
    assert cfg.trainer.backend == "ray" and cfg.ray.rollout == "separate"
    assert cfg.separate_rollout and cfg.algorithm.rollout_correction.enabled
    sync = load_config(f"configs/{preset}")
    assert sync.ray.rollout == "colocated" and not sync.separate_rollout


def test_what_asynchronous_training_cannot_run_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="ray.rollout = separate need trainer.backend=ray"):
        load_config("configs/grpo_tiny.yaml", ["ray.rollout=separate"])
    # a correction the user chose is kept
    cfg = load_config(
        "configs/grpo_tiny.yaml",
        ["trainer.max_staleness=2", "algorithm.rollout_correction.level=sequence"],
    )
    assert cfg.algorithm.rollout_correction.level == "sequence"


def test_the_schedule_fixes_each_rollouts_weights_version_and_bounds_staleness():
    assert [rollout_version(n, 0) for n in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [rollout_version(n, 1) for n in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [rollout_version(n, 2) for n in range(1, 6)] == [0, 0, 0, 1, 2]
    m = staleness_metrics(torch.tensor([2, 2, 3]), 3, 1, 4)
    assert m["async/staleness/max"] == 1.0 and abs(m["async/staleness/mean"] - 2 / 3) < 1e-6
    with pytest.raises(StaleSamples, match=r"step 5: .*versions \[1\].*max_staleness=1"):
        staleness_metrics(torch.tensor([1, 1]), 3, 1, 5)


@pytest.mark.parametrize(
    "extra", [[], ["actor.lora.rank=4", "actor.lora.alpha=8"]], ids=["full", "lora"]
)
def test_a_replica_fed_the_trainers_weights_samples_the_trainers_tokens(extra):
    """After one update (version 1) the weights `publish` sends (full, or LoRA's adapters)
    go into a fresh replica: the same tokens and sampling log-probs as the trainer's own rollout; before, not."""
    from test_engine import SIGNAL

    from hybrid_engine.data import prompt_batch
    from hybrid_engine.engine import Engine
    from hybrid_engine.pool.replica import RolloutReplica
    from hybrid_engine.rollout.base import SamplingParams

    cfg = load_config("configs/grpo_tiny.yaml", [SIGNAL, "actor.optim.lr=1e-2", *extra])
    engine = Engine(cfg)
    engine.update(engine.advantage(engine.reward(engine.rollout(1))))
    prompts = prompt_batch(engine.data.step_rows(2), engine.tokenizer, 64).repeat_interleave(4)
    sampling = SamplingParams(8, 1.0, seed=7, log_probs=True)
    want = engine.actor.generate(prompts, sampling)
    replica = RolloutReplica(cfg, engine.tokenizer)
    fresh = replica.generate(prompts, sampling)
    assert not torch.equal(fresh["rollout_log_probs"], want["rollout_log_probs"])
    published = engine.actor.replica_state_dict()  # what `publish` sends
    if extra:  # LoRA: the adapters alone; the replica's base is its own
        assert published and all(".lora_" in k for k in published)
    else:
        assert published.keys() == engine.actor.full_state_dict().keys()
    assert replica.receive(published, 1) >= 0
    got = replica.generate(prompts, sampling)
    assert replica.weights_version == 1
    assert torch.equal(got["response_ids"], want["response_ids"])
    # the same numbers up to float32 rounding (another module's memory: measured <= 1e-6)
    torch.testing.assert_close(
        got["rollout_log_probs"], want["rollout_log_probs"], atol=1e-5, rtol=0
    )


# --------------------------------------------------------------------------- pipeline
@pytest.fixture(scope="module")
def ray_env(tmp_path_factory, prefect_api):
    """The pool's own local head for this module, stopped at the end with nothing left."""
    with own_ray_head(tmp_path_factory.mktemp("ray"), "async", prefect_api) as env:
        yield env


def run(
    root: Path,
    run_id: str,
    prefect_api: str,
    env: dict,
    fault: str | None = None,
    resume: bool = False,
    extra: tuple[str, ...] = (),
) -> tuple[int, str]:
    args = (
        ["resume", run_id, f"storage.root={root}"]
        if resume
        else [
            "train",
            "configs/grpo_tiny.yaml",
            *ARGS,
            *ASYNC,
            *extra,
            f"storage.root={root}",
            "--run-id",
            run_id,
        ]
    )
    return driver(args, prefect_api, fault=fault, extra_env=env)


@pytest.fixture(scope="module")
def async_reference(tmp_path_factory, prefect_api, ray_env):
    root = tmp_path_factory.mktemp("async-ref")
    db = f"sqlite:///{root}/mlflow.db"
    rc, out = run(
        root, "ref", prefect_api, ray_env, extra=("tracking.enabled=true", f"tracking.uri={db}")
    )
    assert rc == 0, out
    return root / "ref", final_state(fs_for(str(root), None), f"{root}/ref"), db


def test_an_asynchronous_run_keeps_its_schedule_bound_and_prompt_order(async_reference):
    """Each rollout used the version the schedule gives it (step N: N-2), no sample trained
    more than one version stale, the IS weights are 1 where the versions agree and correct
    where they do not, and every prompt of the data order was consumed once, in order."""
    from hybrid_engine.data import PromptData

    run_dir, (_, history), db = async_reference
    steps = run_dir / "steps"
    consumed = []
    for n in range(1, STEPS + 1):
        meta = json.loads((steps / str(n) / "rollout" / "meta.json").read_text())
        batch = load_file(steps / str(n) / "rollout" / "batch.safetensors")
        assert meta["weights_version"] == max(0, n - 2)
        assert batch["weights_version"].eq(max(0, n - 2)).all()
        consumed += [(p["epoch"], r) for p in meta["prompts"] for r in p["rows"]]
        m = json.loads((steps / str(n) / "update" / "meta.json").read_text())["metrics"]
        assert m["async/staleness/max"] == (n - 1) - max(0, n - 2) <= 1
        if n == 1:  # same weights: the replica's sampling log-probs are the trainer's (up to
            # the float rounding of decoding vs one forward pass): the weights are 1
            assert (
                1 - 1e-5
                < m["rollout_corr/rollout_is_min"]
                <= m["rollout_corr/rollout_is_max"]
                < 1 + 1e-5
            )
        else:  # one version behind: the weights move the loss
            assert (
                m["rollout_corr/rollout_is_max"] > 1.01 and m["rollout_corr/rollout_is_min"] < 0.99
            )
    cfg = load_config("configs/grpo_tiny.yaml", ARGS)
    data = PromptData(cfg.data)
    order = [
        (e, r) for n in range(1, STEPS + 1) for e, rows in [data.step_indices(n)] for r in rows
    ]
    assert consumed == order and len(set(consumed)) == len(consumed)
    assert [r["step"] for r in history] == list(range(STEPS + 1))
    # MLflow: the samples' metrics also by the weights version that generated them
    from mlflow.tracking import MlflowClient

    client = MlflowClient(db)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("hybridrl").experiment_id])
    got = client.get_metric_history(mlrun.info.run_id, "by_version/critic/score/mean")
    by_step = {r["step"]: r["critic/score/mean"] for r in history if r["step"]}
    assert sorted((m.step, m.value) for m in got) == sorted(
        (max(0, n - 2), by_step[n]) for n in range(1, STEPS + 1)
    )


def test_killed_at_each_point_of_the_overlap_and_resumed_is_exact(
    tmp_path, prefect_api, ray_env, async_reference
):
    """1: update(2) killed before its commit while rollout(3) (launched after update(1)) is
    held before its commit; 2: SIGTERM as rollout(3) starts beside step 2 (exit 143, the
    rollout abandoned); 3: killed between steps 2 and 3; 4: in step 3's advantage; 5: in
    step 4's update (the pool went on to version 4: checkpoint step_2 is loaded). No
    committed rollout is generated again; the end equals the uninterrupted run."""
    fs = fs_for(str(tmp_path), None)
    run_url = f"{tmp_path}/chain"
    hold = tmp_path / "hold"
    chain = [
        (
            f"step-3/rollout:before_commit=pause:{hold};step-2/update:before_commit=kill",
            -signal.SIGKILL,
        ),
        ("step-3/rollout:start=term", 143),
        ("step-2:end=kill", -signal.SIGKILL),
        ("step-3/advantage:before_commit=kill", -signal.SIGKILL),
        ("step-4/update:before_commit=kill", -signal.SIGKILL),
        (None, 0),
    ]
    logs = []
    for i, (fault, expected) in enumerate(chain):
        before = rollout_markers(fs, run_url)
        rc, out = run(tmp_path, "chain", prefect_api, ray_env, fault, resume=i > 0)
        logs.append(out)
        assert rc == expected, f"{fault}: rc {rc}\n{out}"
        after = rollout_markers(fs, run_url)
        assert all(after[k] == v for k, v in before.items()), "a committed rollout was redone"
    assert "Finished in state Preempted(" in logs[1]
    assert "loaded checkpoint step_2" in logs[5]
    assert_same_run(final_state(fs, run_url), async_reference[1])


@pytest.mark.parametrize("stage", ["rollout", "reward"])
def test_a_fork_of_an_asynchronous_run_is_its_parent_and_keeps_every_prompt_once(
    stage, prefect_api, ray_env, async_reference
):
    """A fork at 3/rollout regenerates step 3's rollout, which uses weights version 1: the
    checkpoint of step 2 cannot serve it (`rollouts_missing`), the fork replays updates 1-2
    from fresh weights. A fork at 3/reward goes on from that checkpoint. Both end as their
    parent did, every prompt of the data order consumed once across inherited and own steps."""
    from hybrid_engine.config import StorageConfig
    from hybrid_engine.data import PromptData
    from storage.store import RunStore

    run_dir, reference, _ = async_reference
    root, run_id = str(run_dir.parent), f"fork-{stage}"
    rc, out = driver(
        [
            "fork",
            "ref",
            "--at",
            f"3/{stage}",
            "--run-id",
            run_id,
            f"storage.root={root}",
            "tracking.enabled=false",
        ],
        prefect_api,
        extra_env=ray_env,
    )
    assert rc == 0, out
    how = "fresh weights, replaying 2" if stage == "rollout" else "loaded checkpoint step_2"
    assert how in out, out
    assert_same_run(final_state(fs_for(root, None), f"{root}/{run_id}"), reference)
    store = RunStore(StorageConfig(root=root), run_id)
    consumed = [
        (p["epoch"], r)
        for n in range(1, STEPS + 1)
        for p in store.load_stage(n, "rollout").meta["prompts"]
        for r in p["rows"]
    ]
    data = PromptData(load_config("configs/grpo_tiny.yaml", ARGS).data)
    assert consumed == [
        (e, r) for n in range(1, STEPS + 1) for e, rows in [data.step_indices(n)] for r in rows
    ]


def test_an_asynchronous_fork_at_a_rollout_may_not_change_what_updates_read(
    async_reference, prefect_api
):
    root = str(async_reference[0].parent)
    rc, out = driver(
        ["fork", "ref", "--at", "3/rollout", f"storage.root={root}", "actor.optim.lr=1e-2"],
        prefect_api,
    )
    assert rc == 1 and "applies the parent's updates 2..2 again" in out, out


def test_a_dead_rollout_replica_and_a_dead_trainer_are_recovered_exactly(
    tmp_path, prefect_api, ray_env, async_reference
):
    """rollout-0 killed inside step 3's generate call (beside step 2's update: once the replica
    reports sampled tokens), actor-0 killed 0.1 s into step 4's update: two recoveries, and
    the same weights as the uninterrupted run (a fresh run with the same seed: asynchronous
    training is deterministic)."""
    fault = (
        "step-3/rollout:start=kill-worker:rollout-0@generating;"
        "step-4/update:start=kill-worker:actor-0@0.1"
    )
    log = tmp_path / "faults.log"
    rc, out = run(
        tmp_path, "healed", prefect_api, {**ray_env, "HYBRIDRL_FAULT_LOG": str(log)}, fault
    )
    assert rc == 0, out
    assert "recovered from 2 worker fault(s)" in out
    events = json.loads((tmp_path / "healed" / "run.json").read_text())["recoveries"]
    assert [(e["worker"], e["how"]) for e in events] == [("rollout-0", "died"), ("actor-0", "died")]
    # rollout-0 died inside step 3's generate call, beside step 2's update: the driver sees
    # it first in update 2's worker status if that ends meanwhile, else in the rollout call
    killed = [x for x in log.read_text().splitlines() if "rollout-0@generating:" in x]
    assert len(killed) == 1 and "signalled while generating ({'tokens'" in killed[0], killed
    assert events[0]["where"] in ("step-2/update", "step-3/rollout")
    assert_same_run(
        final_state(fs_for(str(tmp_path), None), f"{tmp_path}/healed"), async_reference[1]
    )


def test_a_separate_rollout_group_without_staleness_equals_the_colocated_run(
    tmp_path, prefect_api, ray_env, reference
):
    """trainer.max_staleness=0 with ray.rollout=separate: every rollout waits for the last
    update's weights, sent to the replica; weights and metrics are bit-equal to the
    in-process run's (which has no staleness metrics)."""
    rc, out = run(
        tmp_path,
        "sep",
        prefect_api,
        ray_env,
        extra=("trainer.max_staleness=0", "trainer.backend=ray", "ray.rollout=separate"),
    )
    assert rc == 0, out
    weights, history = final_state(fs_for(str(tmp_path), None), f"{tmp_path}/sep")
    assert all(row.get("async/staleness/max", 0) == 0 for row in history)
    plain = [{k: v for k, v in row.items() if not k.startswith("async/")} for row in history]
    assert_same_run((weights, plain), reference)
