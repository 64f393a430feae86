"""Forks: a run that takes another's committed stages up to a point (referenced by their
sha256, not copied) and computes the rest with its own overrides.

The reference run (4 steps, checkpoints at 2 and 4) is forked at each stage kind of step 3.
Without overrides a fork must be its parent bit for bit (the stages it computes again are
deterministic from the parent's checkpoint and stored updates); with one it must hold only
what it computed itself, reading the rest through its lineage."""

from __future__ import annotations

import json

import pytest
import torch
from run_driver import ARGS, assert_same_run, driver, final_state, fs_for

from hybrid_engine import STAGES
from hybrid_engine.config import StorageConfig, load_config
from storage.lineage import ForkPoint
from storage.store import RunStore


def fork(root: str, parent: str, at: str, run_id: str, prefect_api: str, *overrides: str):
    return driver(
        ["fork", parent, "--at", at, "--run-id", run_id, f"storage.root={root}", *overrides],
        prefect_api,
    )


def own_stage_dirs(root: str, run_id: str) -> set[str]:
    fs = fs_for(root, None)
    return {p.split("/steps/")[1] for p in fs.glob(f"{root}/{run_id}/steps/*/*")}


@pytest.mark.parametrize("stage", STAGES)
def test_a_fork_without_overrides_is_its_parent(stage, reference_run, prefect_api):
    root, reference = reference_run
    run_id = f"same-{stage}"
    rc, out = fork(root, "ref", f"3/{stage}", run_id, prefect_api)
    assert rc == 0, out
    assert_same_run(final_state(fs_for(root, None), f"{root}/{run_id}"), reference)
    # it holds only what it computed: step 3 from `stage` on, and step 4
    computed = {f"3/{s}" for s in STAGES[STAGES.index(stage) :]}
    assert own_stage_dirs(root, run_id) == computed | {f"4/{s}" for s in STAGES} | {"4/validate"}
    doc = json.loads(fs_for(root, None).cat_file(f"{root}/{run_id}/run.json"))
    assert doc["lineage"]["parent"] == "ref" and doc["lineage"]["at"] == f"3/{stage}"
    # a fork at 3/rollout computes all of step 3: it inherits steps 0-2 only
    inherited = ["0", "1", "2"] if stage == "rollout" else ["0", "1", "2", "3"]
    assert sorted(doc["lineage"]["steps"]) == inherited
    assert sorted(doc["lineage"]["checkpoints"]) == ["2"]


def test_a_fork_reads_its_parents_objects_and_computes_the_rest_with_its_overrides(
    reference_run, prefect_api
):
    root, (ref_weights, _) = reference_run
    rc, out = fork(
        root,
        "ref",
        "3/advantage",
        "rloo",
        prefect_api,
        "algorithm.adv_estimator=rloo",
        "actor.optim.lr=2e-3",
    )
    assert rc == 0, out
    assert "a fork of ref at 3/advantage" in out
    storage = StorageConfig(root=root)
    parent, child = RunStore(storage, "ref"), RunStore(storage, "rloo")
    for step, stage in [(1, "rollout"), (2, "update"), (3, "rollout"), (3, "reward")]:
        got = child.load_stage(step, stage)  # the parent's objects, through the lineage
        assert got.uri == parent.load_stage(step, stage).uri
    mine, theirs = child.load_stage(3, "advantage"), parent.load_stage(3, "advantage")
    assert mine.uri.startswith(child.url)
    assert torch.equal(mine.batch["response_ids"], theirs.batch["response_ids"])
    assert not torch.equal(mine.batch["advantages"], theirs.batch["advantages"])
    weights, history = final_state(fs_for(root, None), f"{root}/rloo")
    assert any(not torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert [r["step"] for r in history] == [0, 1, 2, 3, 4]  # the parent's rows, then its own
    # a checkpoint the fork inherits is read where the parent wrote it
    assert child.checkpoints() == [2, 4] and child.checkpoints(own=True) == [4]
    assert child.locate("checkpoints/step_2") is not child


def test_what_a_fork_may_change_depends_on_its_stage():
    from flows.opening import refused_fork_changes

    base = load_config("configs/grpo_tiny.yaml")

    def refused(at: str, *overrides: str) -> list[str]:
        got = refused_fork_changes(
            base, load_config("configs/grpo_tiny.yaml", list(overrides)), ForkPoint.parse(at)
        )
        return [r.split(" ")[0].split("=")[0] for r in got]

    assert refused("3/advantage", "algorithm.adv_estimator=rloo", "actor.optim.lr=1e-3") == []
    assert refused("3/advantage", "rollout.temperature=0.5") == ["rollout.temperature"]
    assert refused("3/advantage", "reward.overlong_buffer_len=4") == ["reward.overlong_buffer_len"]
    assert refused("3/reward", "reward.overlong_buffer_len=4") == []
    assert refused("3/update", "algorithm.adv_estimator=rloo") == ["algorithm.adv_estimator"]
    assert refused("3/update", "actor.optim.lr=1e-3", "actor.clip_ratio_high=0.28") == []
    assert refused("3/rollout", "rollout.temperature=0.5", "rollout.n=4") == []
    for at in ("3/rollout", "3/update"):  # what every step reads
        assert refused(at, "data.train_batch_size=2", "trainer.seed=7") == [
            "data.train_batch_size",
            "trainer.seed",
        ]
    gae = ("algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=16")
    assert refused("3/rollout", *gae) == ["algorithm.adv_estimator"]
    assert refused("3/reward", "algorithm.adv_estimator=remax") == ["algorithm.adv_estimator"]
    assert refused("3/rollout", "algorithm.adv_estimator=remax") == []
    assert refused("3/update", "storage.root=/elsewhere", "trainer.total_training_steps=9") == []


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["3/advantage", "rollout.temperature=0.5"],
            "cannot change rollout.temperature (step 3's rollout",
        ),
        (["9/rollout"], "its stage 5/rollout is not committed"),
        (["3/loss"], "STAGE one of rollout, reward, advantage, update"),
    ],
)
def test_a_refused_fork_fails_in_one_line_before_anything_is_written(
    args, needle, reference_run, prefect_api
):
    root, _ = reference_run
    rc, out = fork(root, "ref", args[0], "refused", prefect_api, *args[1:])
    assert rc == 1 and needle in out, out
    assert len([line for line in out.splitlines() if line.strip()]) == 1, out
    assert not fs_for(root, None).exists(f"{root}/refused")


def test_deleting_a_parent_keeps_what_its_fork_uses_and_the_last_fork_takes_it(
    tmp_path, prefect_api
):
    root = str(tmp_path)
    args = [a for a in ARGS if not a.startswith("trainer.total_training_steps")]
    rc, out = driver(
        [
            "train",
            "configs/grpo_tiny.yaml",
            *args,
            "trainer.total_training_steps=2",
            "trainer.save_freq=1",
            f"storage.root={root}",
            "--run-id",
            "p",
        ],
        prefect_api,
    )
    assert rc == 0, out
    rc, out = fork(root, "p", "2/advantage", "f", prefect_api, "actor.optim.lr=2e-3")
    assert rc == 0, out
    storage = StorageConfig(root=root)
    p_run = f"{root}/p"
    fs = fs_for(root, None)
    rollout_2 = fs.cat_file(f"{p_run}/steps/2/rollout/batch.safetensors")

    cli = ["runs", "delete", "--yes", "--storage-root", root]
    rc, out = driver([*cli, "p"], prefect_api)
    assert rc == 0 and "that forks f use" in out, out
    kept = sorted(p.split("/p/")[1] for p in fs_for(root, None).glob(f"{p_run}/**/COMMITTED"))
    assert kept == [
        "checkpoints/step_1/COMMITTED",
        "steps/0/validate/COMMITTED",
        "steps/1/advantage/COMMITTED",
        "steps/1/reward/COMMITTED",
        "steps/1/rollout/COMMITTED",
        "steps/1/update/COMMITTED",
        "steps/2/reward/COMMITTED",
        "steps/2/rollout/COMMITTED",
    ]
    assert not fs_for(root, None).exists(f"{p_run}/final")
    child = RunStore(storage, "f")
    assert child.load_stage(2, "rollout").batch.to_bytes() is not None
    assert fs.cat_file(f"{p_run}/steps/2/rollout/batch.safetensors") == rollout_2
    # the fork goes on through its deleted parent's kept objects; the parent cannot
    rc, out = driver(
        ["resume", "f", f"storage.root={root}", "trainer.total_training_steps=3"], prefect_api
    )
    assert rc == 0, out
    rc, out = driver(["resume", "p", f"storage.root={root}"], prefect_api)
    assert rc == 1 and "was deleted" in out, out
    rc, out = driver(["runs", "tree", "f", "--storage-root", root], prefect_api)
    assert "deleted; kept for its forks" in out and "forked at 2/advantage" in out, out

    rc, out = driver([*cli, "f"], prefect_api)
    assert rc == 0 and "removed deleted run p" in out, out
    assert fs_for(root, None).ls(root, detail=False) == [], "objects outlived every run"


def test_a_fork_that_changes_the_update_starts_from_the_parents_weights_made_with_its_values(
    reference_run, prefect_api
):
    """The reference has checkpoints 2 and 4; a fork at 4/advantage with another learning
    rate needs weights version 3, which update 3 made with the parent's learning rate: the
    fork makes checkpoint step_3 with the parent's config first, then trains with its own."""
    from safetensors.torch import load as st_load

    from hybrid_engine.config import config_from_dict
    from hybrid_engine.engine import Engine
    from tasks.replay import Replayer

    root, _ = reference_run
    rc, out = fork(root, "ref", "4/advantage", "lr", prefect_api, "actor.optim.lr=5e-3")
    assert rc == 0, out
    assert "saved as the fork's checkpoint step_3" in out, out
    storage = StorageConfig(root=root)
    child, parent = RunStore(storage, "lr"), RunStore(storage, "ref")
    assert child.checkpoints(own=True) == [3, 4]
    made = st_load(child.get("checkpoints/step_3/actor/model.safetensors"))
    engine = Engine(config_from_dict(parent.read_run()["config"], [f"storage.root={root}"]))
    Replayer(engine, parent).weights_at(3)
    state = engine.actor.full_state_dict()
    assert all(torch.equal(made[k], state[k]) for k in made)
