"""The stage-state store on a local directory and on a real S3 server (moto, 127.0.0.1):
commits are all-or-nothing, corruption is caught by hash, run ids cannot escape the root,
checkpoints are pruned oldest first, credentials stay out of the config."""

import json
import logging

import pytest
import torch

from hybrid_engine.batch import Batch
from hybrid_engine.config import ConfigError, StorageConfig, load_config
from storage.store import storage_options, validate_run_id

pytestmark = pytest.mark.fast  # the inner loop: bash scripts/test.sh -m fast


def a_batch() -> Batch:
    return Batch(
        {"x": torch.arange(6.0).reshape(2, 3), "ids": torch.tensor([[1, 2], [3, 4]])},
        {"uid": ["a", "b"]},
        {"metrics": {"m": 1.5}},
    )


def test_commit_round_trip_and_latest(store):
    b = a_batch()
    uri = store.commit_stage(3, "reward", b, {"metrics": {"m": 1.5}, "wall_s": 0.1})
    assert uri.endswith("/r1/steps/3/reward")
    got = store.load_stage(3, "reward")
    assert torch.equal(got.batch["x"], b["x"]) and got.batch["uid"] == ["a", "b"]
    assert got.meta["metrics"] == {"m": 1.5} and got.batch.meta["metrics"] == {"m": 1.5}
    assert store.read_latest()["step"] == 3 and store.read_latest()["stage"] == "reward"
    marker = json.loads(store.get("steps/3/reward/COMMITTED"))
    assert set(marker["files"]) == {"batch.safetensors", "batch.json", "meta.json"}


def test_half_written_stage_is_invisible(store):
    tensors, doc = a_batch().to_bytes()
    store.put("steps/1/rollout/batch.safetensors", tensors)  # a crash before the marker
    store.put("steps/1/rollout/batch.json", doc)
    assert store.load_stage(1, "rollout") is None and not store.is_committed(1, "rollout")


def test_corrupted_object_is_named_and_the_stage_is_redone(store, caplog):
    store.commit_stage(2, "rollout", a_batch(), {})
    data = bytearray(store.get("steps/2/rollout/batch.safetensors"))
    data[-1] ^= 1
    store.put("steps/2/rollout/batch.safetensors", bytes(data))
    with caplog.at_level(logging.WARNING, "hybridrl.storage"):
        assert store.load_stage(2, "rollout") is None
    assert "steps/2/rollout/batch.safetensors: sha256 differs" in caplog.text
    store.commit_stage(2, "rollout", a_batch(), {})  # redone: committed again
    assert store.load_stage(2, "rollout") is not None


def test_checkpoints_are_listed_and_pruned_oldest_first(store):
    for step in (2, 4, 6):
        sha = store.put(f"checkpoints/step_{step}/actor/model.safetensors", b"w%d" % step)
        store.commit_checkpoint(step, {"actor/model.safetensors": sha}, {"kl_coef": 0.0})
    store.put("checkpoints/step_8/actor/model.safetensors", b"half")  # never committed
    assert store.checkpoints() == [2, 4, 6]
    assert store.prune_checkpoints(2) == [2]
    assert store.checkpoints() == [4, 6] and not store.exists("checkpoints/step_2")
    files, meta = store.checkpoint_files(6)
    assert "actor/model.safetensors" in files and meta == {"kl_coef": 0.0}
    assert store.read_latest()["checkpoint"] == 6


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "..", "-x", ".hidden", "x" * 129, "a b"])
def test_run_ids_cannot_escape_the_root(bad):
    with pytest.raises(ValueError, match="run id"):
        validate_run_id(bad)
    assert validate_run_id("grpo_tiny-20261129-120000.2") == "grpo_tiny-20261129-120000.2"


def test_credentials_come_from_the_environment_only(monkeypatch):
    with pytest.raises(ConfigError, match="storage.secret: credentials never go"):
        load_config(None, ["storage.secret=abc"])
    with pytest.raises(ConfigError, match="credentials never go in the URL") as e:
        load_config(None, ["storage.root=s3://AKIA:hunter2@bucket/x"])
    assert "hunter2" not in str(e.value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    cfg = StorageConfig(root="s3://b/p", endpoint_url="http://127.0.0.1:1")
    assert "key" not in storage_options(cfg)  # s3fs reads the environment itself
    assert storage_options(cfg, credentials=True)["secret"] == "s3cr3t"  # for Ray workers
    assert storage_options(StorageConfig(root="/tmp/x"), credentials=True) == {}


@pytest.mark.parametrize("mode", ["ignore", "reject"])
def test_a_store_that_cannot_create_conditionally_is_refused_at_start(s3_endpoint, mode):
    """moto 5 honours `If-None-Match: *` (a second create gets 412); through a real HTTP
    proxy that drops the header, or answers it 501, the store cannot give a run one writer:
    `check_storage` and the lease refuse it in one line (never a raw OSError), unless
    storage.single_driver says only one driver ever trains a run there."""
    import time

    from servers import ConditionalProxy

    from storage.lease import RunLease
    from storage.probe import check_storage
    from storage.store import RunStore

    bucket = f"cond-{mode}-{int(time.time() * 1e6)}"
    direct = StorageConfig(root=f"s3://{bucket}/runs", endpoint_url=s3_endpoint)
    fs = RunStore(direct, "r1").fs
    fs.mkdir(bucket)
    check_storage(direct)  # the real server: accepted
    assert fs.ls(bucket, refresh=True) == []  # the probe leaves nothing behind
    proxy = ConditionalProxy(int(s3_endpoint.rsplit(":", 1)[1]), mode)
    try:
        cfg = StorageConfig(root=f"s3://{bucket}/runs", endpoint_url=proxy.url)
        for attempt in (
            lambda: check_storage(cfg),
            lambda: RunLease(RunStore(cfg, "r1"), 60).acquire(),
        ):
            with pytest.raises(Exception) as refused:
                attempt()
            line = str(refused.value)
            assert not isinstance(refused.value, OSError), repr(refused.value)
            assert "\n" not in line and f"storage.root={cfg.root!r}" in line, line
            assert "If-None-Match" in line and "storage.single_driver=true" in line, line
        assert proxy.seen >= 2
        single = StorageConfig(
            root=f"s3://{bucket}/runs", endpoint_url=proxy.url, single_driver=True
        )
        check_storage(single)
        lease = RunLease(RunStore(single, "r1"), 60)
        assert lease.acquire() is None
        lease.release()
    finally:
        proxy.close()
