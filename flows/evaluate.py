"""The `evaluate` flow: a policy on its run's held-out questions (greedy accuracy, pass@k,
maj@k, response lengths, format), logged to MLflow as an evaluation run nested under the
training run; for a registered version, the promotion gate (`storage.tracking.model_registry.gate`).

    evaluate(model="hybridrl-policy/3")      a registered version (NAME/VERSION, NAME@ALIAS,
                                             or models:/...), loaded back with one MLflow call
    evaluate(run_id="demo-1")                a run's final policy (final/)
    evaluate(run_id="demo-1", step=20)       a run's checkpoint step_20

The policy is evaluated in this process on the run's own data, reward and sampling settings
(`hybrid_engine.evaluation`). A deployment of it (`deployments/prefect.yaml`) runs by itself
when a training run finishes: the train flow emits `hybridrl.run.finished` with the version
it registered.
"""

from __future__ import annotations

import tempfile
from typing import Any

from prefect import flow, get_run_logger

from hybrid_engine.config import HybridConfig, StorageConfig, config_from_dict
from hybrid_engine.engine import Engine
from hybrid_engine.evaluation import evaluate_policy
from storage.store import RunStore
from storage.tracking.tracker import client_for, usable_uri
from storage.tracking.tracker import tracking_uri as default_tracking_uri
from tasks.publish import IN_PROCESS


def eval_run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters
    what = p.get("model") or f"{p.get('run_id')}" + (f"@{p['step']}" if p.get("step") else "")
    return f"eval-{what}".replace("/", "-").replace(":", "-")


@flow(name="evaluate", flow_run_name=eval_run_name, log_prints=True)
def evaluate(
    model: str | None = None,
    run_id: str | None = None,
    step: int | None = None,
    k: int | None = None,
    promote: bool = True,
    storage_root: str | None = None,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Evaluate a registered model version (`model`) or a run's final policy / checkpoint
    (`run_id`, `step`) with `k` samples per question (default registry.eval_k), log the
    metrics to MLflow and, for a version, decide its promotion to `champion`."""
    logger = get_run_logger()
    if (model is None) == (run_id is None):
        raise ValueError("evaluate: give either model (a registered version) or run_id")
    uri = usable_uri(tracking_uri or default_tracking_uri(HybridConfig()))  # its password
    client = client_for(uri)
    version = None
    if model is not None:
        version = resolve_version(client, model)
        run_id = version.tags["hybridrl.run_id"]
        storage_root = version.tags["hybridrl.storage_uri"].rsplit("/", 1)[0]
    store = RunStore(
        StorageConfig(root=storage_root) if storage_root else HybridConfig().storage, run_id
    )
    doc = store.read_run()
    if doc is None:
        raise FileNotFoundError(f"no run {run_id!r} under {store.cfg.root}")
    with tempfile.TemporaryDirectory(prefix="hybridrl-eval-") as tmp:
        cfg, engine, what = policy_engine(doc, store, version, step, tmp, uri)
        k = k or cfg.registry.eval_k
        logger.info(
            "evaluating %s on %d held-out questions, %d samples each", what, len(engine.data.val), k
        )
        metrics = evaluate_policy(engine, k)
    logger.info("%s: %s", what, ", ".join(f"{m} {v:.3f}" for m, v in metrics.items()))
    log_evaluation(client, doc, cfg, what, metrics)
    result: dict[str, Any] = {"evaluated": what, "metrics": metrics}
    if version is not None and promote:
        from storage.tracking.model_registry import gate

        promoted, why = gate(client, version.name, version.version, metrics, cfg.registry)
        logger.info("%s v%s %s", version.name, version.version, why)
        result |= {"promoted": promoted, "why": why}
    return result


def resolve_version(client: Any, model: str) -> Any:
    """NAME/VERSION, NAME@ALIAS or models:/NAME/VERSION|@ALIAS -> the ModelVersion."""
    ref = model.removeprefix("models:/")
    if "@" in ref:
        name, alias = ref.split("@", 1)
        return client.get_model_version_by_alias(name, alias)
    name, _, number = ref.rpartition("/")
    if not name or not number.isdigit():
        raise ValueError(f"model={model!r}: write NAME/VERSION or NAME@ALIAS")
    return client.get_model_version(name, number)


def policy_engine(
    doc: dict, store: RunStore, version: Any, step: int | None, tmp: str, tracking: str
) -> tuple[HybridConfig, Engine, str]:
    """An in-process engine on the run's config holding the policy to evaluate."""
    overrides = [*IN_PROCESS, f"storage.root={store.cfg.root}"]
    if version is not None:  # the registered policy, loaded back through MLflow
        from storage.tracking.model_registry import load

        pipe = load(f"models:/{version.name}/{version.version}", tracking)
        pipe.model.save_pretrained(tmp)
        pipe.tokenizer.save_pretrained(tmp)
        what = f"{version.name} v{version.version}"
        overrides += [f"model.path={tmp}", "actor.lora.rank=0"]
    elif step is None:  # final/ (a local copy when it lives on S3)
        final = store.local_dir("final", tmp)
        what = f"{store.run_id} final"
        overrides += [f"model.path={final}", "actor.lora.rank=0"]
    else:
        what = f"{store.run_id} checkpoint step_{step}"
    cfg = config_from_dict(doc["config"], overrides)
    engine = Engine(cfg)
    if version is None and step is not None:
        from tasks.checkpoint import load_checkpoint

        if not load_checkpoint(engine, store, step):
            raise FileNotFoundError(f"run {store.run_id} has no usable checkpoint step_{step}")
    return cfg, engine, what


def log_evaluation(
    client: Any, doc: dict, cfg: HybridConfig, what: str, metrics: dict[str, float]
) -> str:
    """An MLflow run `eval <what>` in the run's experiment, nested under its training run."""
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(cfg.tracking.experiment)
    tags = {"hybridrl.evaluates": what, "hybridrl.run_id": doc["run_id"]}
    if doc.get("mlflow_run_id"):
        tags["mlflow.parentRunId"] = doc["mlflow_run_id"]
    run = client.create_run(exp_id, run_name=f"eval {what}", tags=tags)
    for key, value in metrics.items():
        client.log_metric(run.info.run_id, key, value)
    client.set_terminated(run.info.run_id)
    return run.info.run_id
