"""The MLflow Model Registry: a finished run registers its final policy (lineage as tags),
which loads back with one MLflow call; a checkpoint registers on request; `evaluate` scores
a version (greedy accuracy, pass@k, maj@k) in an MLflow run nested under the training run;
the promotion gate gives the alias `champion` only to a version that beats the champion by
the margin and passes the sanity checks, and tags the others with why not."""

from __future__ import annotations

import pytest
import torch
from run_driver import ARGS, driver
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def registered(tmp_path_factory, prefect_api):
    root = tmp_path_factory.mktemp("registry")
    db = f"sqlite:///{root}/mlflow.db"
    args = [a for a in ARGS if not a.startswith(("tracking.", "trainer.total_training_steps"))]
    rc, out = driver(
        [
            "train",
            "configs/grpo_tiny.yaml",
            *args,
            "trainer.total_training_steps=2",
            f"storage.root={root}",
            f"tracking.uri={db}",
            "registry.min_format_rate=0",
            "registry.max_clip_ratio=1",
            "--run-id",
            "r",
        ],
        prefect_api,
    )
    assert rc == 0, out
    assert "registered as hybridrl-policy/1" in out, out
    return root, db


def client(db: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(db)


def test_the_final_policy_is_a_version_that_loads_back_with_one_call(registered):
    import mlflow

    root, db = registered
    v = client(db).get_model_version("hybridrl-policy", "1")
    assert v.tags["hybridrl.run_id"] == "r" and v.tags["hybridrl.source"] == "final"
    assert v.tags["hybridrl.step"] == "2" and "val.accuracy" in v.tags
    assert v.tags["hybridrl.storage_uri"] == f"{root}/r"
    mlflow.set_tracking_uri(db)
    pipe = mlflow.transformers.load_model("models:/hybridrl-policy/1")  # the one call
    final = load_file(root / "r/final/model.safetensors")
    state = pipe.model.state_dict()
    assert all(torch.equal(final[k], state[k]) for k in final)
    assert pipe.tokenizer.chat_template is not None


def test_evaluate_then_the_gate_promotes_the_first_and_refuses_an_equal_second(
    registered, prefect_api
):
    root, db = registered
    rc, out = driver(
        ["register", "r", "--step", "2", "--storage-root", str(root)],
        prefect_api,
        extra_env={"MLFLOW_TRACKING_URI": db},
    )
    assert rc == 0 and "registered as hybridrl-policy/2" in out, out
    evaluate = ["evaluate", "--tracking-uri", db, "--k", "2"]
    rc, out = driver([*evaluate, "hybridrl-policy/1"], prefect_api)
    assert rc == 0 and "champion: accuracy" in out, out
    for key in ("eval/accuracy", "eval/pass_at_2", "eval/maj_at_2", "eval/format_rate"):
        assert key in out, out
    c = client(db)
    assert c.get_model_version_by_alias("hybridrl-policy", "champion").version == 1
    # the checkpoint of the same step holds the same weights: equal accuracy, not promoted
    rc, out = driver([*evaluate, "hybridrl-policy/2"], prefect_api)
    assert rc == 0 and "not promoted: accuracy" in out and "champion v1's" in out, out
    v2 = c.get_model_version("hybridrl-policy", "2")
    assert v2.tags["hybridrl.promotion"].startswith("not promoted: accuracy")
    assert (
        v2.tags["eval.accuracy"]
        == c.get_model_version("hybridrl-policy", "1").tags["eval.accuracy"]
    )
    assert c.get_model_version_by_alias("hybridrl-policy", "champion").version == 1
    # each evaluation is an MLflow run nested under the training run
    training = c.get_model_version("hybridrl-policy", "1").run_id
    evals = c.search_runs(
        [c.get_run(training).info.experiment_id], f"tags.`mlflow.parentRunId` = '{training}'"
    )
    assert sorted(r.info.run_name for r in evals) == [
        "eval hybridrl-policy v1",
        "eval hybridrl-policy v2",
    ]


def test_the_gate_checks_accuracy_margin_format_and_lengths(tmp_path):
    """The gate on real registered versions (sources need not load: it reads tags)."""
    from hybrid_engine.config import RegistryConfig
    from storage.tracking.model_registry import gate

    c = client(f"sqlite:///{tmp_path}/mlflow.db")
    c.create_registered_model("m")
    for _ in range(5):
        c.create_model_version("m", source=str(tmp_path))
    cfg = RegistryConfig(promotion_margin=0.02, min_format_rate=0.8)
    ok = {
        "eval/accuracy": 0.40,
        "eval/format_rate": 0.9,
        "eval/response_length/mean": 20.0,
        "eval/clip_ratio": 0.1,
    }
    assert gate(c, "m", "1", ok, cfg) == (True, "champion: accuracy 0.400")
    promoted, why = gate(c, "m", "2", ok | {"eval/accuracy": 0.41}, cfg)
    assert not promoted and "accuracy 0.410 < champion v1's 0.400 + margin 0.02" in why
    promoted, why = gate(c, "m", "3", ok | {"eval/accuracy": 0.5, "eval/format_rate": 0.5}, cfg)
    assert not promoted and "format kept in 0.50 of responses" in why
    promoted, why = gate(
        c, "m", "4", ok | {"eval/accuracy": 0.5, "eval/response_length/mean": 45.0}, cfg
    )
    assert not promoted and "mean length 45.0 is 2.25x the champion's 20.0" in why
    assert gate(c, "m", "5", ok | {"eval/accuracy": 0.5}, cfg) == (
        True,
        "champion: accuracy 0.500 (was v1)",
    )
    assert c.get_model_version_by_alias("m", "champion").version == 5
    assert c.get_model_version("m", "4").tags["hybridrl.promotion"].startswith("not promoted")
