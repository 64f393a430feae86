import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/servers.py, reward_fns.py, weights.py

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The environment the suite was started with, before the libraries the tests import set
# their own variables in this process (Ray sets RAY_CLIENT_MODE, tasks/ Prefect's defaults):
# driver processes start from this, as they would from a shell.
PRISTINE_ENV = dict(os.environ)


@pytest.fixture(scope="session")
def tokenizer():
    from hybrid_engine.config import ModelConfig
    from hybrid_engine.models.loading import load_tokenizer

    return load_tokenizer(ModelConfig(path="tiny"))


@pytest.fixture(scope="session")
def tiny_cfg():
    from hybrid_engine.config import load_config

    return load_config("configs/grpo_tiny.yaml")


# What the fast tier (`-m fast`) may not use: servers, Ray heads, training runs.
NOT_FAST = {"prefect_api", "reference", "reference_run", "ray_env", "async_reference"}
NOT_FAST |= {"ray_head", "ray_state", "cluster", "registered", "setup"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        used = NOT_FAST & set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("fast") and used:
            raise pytest.UsageError(f"{item.nodeid} is marked fast but uses {sorted(used)}")


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real Prefect API (`prefect server start` on 127.0.0.1), shared by the driver
    processes of the pipeline tests so that each does not start its own temporary one."""
    from servers import start_prefect, stop

    proc, url = start_prefect(tmp_path_factory.mktemp("prefect-home"))
    yield url
    stop(proc)


@pytest.fixture(scope="session")
def s3_endpoint():
    """The S3-compatible server `.ci/run` started ($HYBRIDRL_TEST_S3), else one of our own
    (moto's standalone server); the AWS credentials the tests use are set for this process."""
    from servers import start_moto, stop

    os.environ.update(S3_ENV)
    proc = None
    url = os.environ.get("HYBRIDRL_TEST_S3")
    if not url:
        proc, url = start_moto()
    yield url
    if proc is not None:
        stop(proc)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, prefect_api):
    """The uninterrupted 4-step run of the pipeline tests (local storage, in-process roles):
    (storage root, its final state). Forks of it live beside it (tests/test_fork.py)."""
    from run_driver import ARGS, driver, final_state, fs_for

    root = str(tmp_path_factory.mktemp("ref"))
    rc, out = driver(
        ["train", "configs/grpo_tiny.yaml", *ARGS, f"storage.root={root}", "--run-id", "ref"],
        prefect_api,
    )
    assert rc == 0, out
    assert "(from storage" not in out  # nothing to skip in a fresh run
    return root, final_state(fs_for(root, None), f"{root}/ref")


@pytest.fixture(scope="session")
def reference(reference_run):
    """The reference run's final weights and per-step metrics."""
    return reference_run[1]


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """Run `r1`'s store on a local directory, and on the S3 server (a bucket of its own)."""
    import time

    from hybrid_engine.config import StorageConfig
    from storage.store import RunStore

    if request.param == "local":
        return RunStore(StorageConfig(root=str(tmp_path / "runs")), "r1")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"store-{int(time.time() * 1e6)}"
    s = RunStore(StorageConfig(root=f"s3://{bucket}/runs", endpoint_url=endpoint), "r1")
    s.fs.mkdir(bucket)
    return s
