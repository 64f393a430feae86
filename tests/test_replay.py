"""Replay (audit): a committed stage recomputed from its stored input and the weights it saw
must be bit-equal to what is stored; a stored tensor that the run could not have produced is
reported by name with its largest difference."""

from __future__ import annotations

from run_driver import ARGS, driver

from hybrid_engine.config import StorageConfig
from storage.store import RunStore


def replay(root: str, prefect_api: str, *args: str):
    return driver(["replay", *args, "--storage-root", root], prefect_api)


def test_every_stage_of_a_run_and_of_its_fork_replays_bit_equal(reference_run, prefect_api):
    root, _ = reference_run
    rc, out = replay(root, prefect_api, "ref", "--all")
    assert rc == 0, out
    stages = ["0/validate"] + [
        f"{n}/{s}" for n in range(1, 5) for s in ("rollout", "reward", "advantage", "update")
    ]
    stages += ["2/validate", "4/validate"]
    for stage in stages:
        assert f"{stage}: bit-equal" in out, out
    assert "all equal" in out
    # a fork replays through its lineage: the parent's stages, then its own
    rc, out = driver(
        [
            "fork",
            "ref",
            "--at",
            "3/advantage",
            "--run-id",
            "audited",
            f"storage.root={root}",
            "algorithm.adv_estimator=rloo",
        ],
        prefect_api,
    )
    assert rc == 0, out
    rc, out = replay(root, prefect_api, "audited", "--all")
    assert rc == 0, out
    own = [
        "3/advantage",
        "3/update",
        "4/rollout",
        "4/reward",
        "4/advantage",
        "4/update",
        "4/validate",
    ]
    for stage in stages:
        how = "bit-equal" if stage in own else "inherited from ref"
        assert f"{stage}: {how}" in out, out


def test_an_altered_stage_is_reported_with_its_first_difference(tmp_path, prefect_api):
    root = str(tmp_path)
    args = [a for a in ARGS if not a.startswith("trainer.total_training_steps")]
    rc, out = driver(
        [
            "train",
            "configs/grpo_tiny.yaml",
            *args,
            "trainer.total_training_steps=2",
            f"storage.root={root}",
            "--run-id",
            "r",
        ],
        prefect_api,
    )
    assert rc == 0, out
    rc, out = replay(root, prefect_api, "r", "2/advantage")
    assert rc == 0 and "2/advantage: bit-equal" in out, out
    store = RunStore(StorageConfig(root=root), "r")
    stored = store.load_stage(2, "advantage")
    batch = stored.batch
    batch["advantages"] = batch["advantages"].clone()
    batch["advantages"][1, 0] += 0.25  # as if the run had computed another value
    store.commit_stage(2, "advantage", batch, stored.meta)
    rc, out = replay(root, prefect_api, "r", "2/advantage")
    assert rc == 1 and "2/advantage: advantages: max |difference| 0.25" in out, out
    update = store.load_stage(1, "update")
    metrics = dict(update.meta["metrics"], **{"actor/pg_loss": 1.0})
    store.commit_stage(1, "update", None, dict(update.meta, metrics=metrics))
    rc, out = replay(root, prefect_api, "r", "--all")
    assert rc == 1 and "1/update: metric actor/pg_loss: stored 1.0" in out, out
    # the stored update of step 2 did not come from the altered batch: it differs too
    assert "2/update: metric actor/entropy" in out and "3 stage(s) differ" in out, out
    rc, out = replay(root, prefect_api, "r", "2/loss")
    assert rc == 1 and "STAGE one of rollout, reward, advantage, update, validate" in out, out
