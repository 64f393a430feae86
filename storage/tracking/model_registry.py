"""The MLflow Model Registry: a run's policy as a registered model version, and the promotion
gate for the alias `champion`.

    register(cfg, store, policy_dir, what)   the policy (a Hugging Face directory) logged with
                                             MLflow's transformers flavour into the run's
                                             MLflow run and registered as the next version of
                                             registry.model_name; its lineage as version tags
    load(uri, tracking)                      `mlflow.transformers.load_model(uri)`: a
                                             text-generation pipeline, one call
    gate(client, name, version, metrics, c)  the alias `champion` when the version beats the
                                             champion by registry.promotion_margin and its
                                             responses pass the sanity checks; else a tag
                                             saying why not

Version tags: `hybridrl.run_id`, `hybridrl.step`, `hybridrl.storage_uri`, `hybridrl.source`
(final/ or checkpoints/step_N), `hybridrl.parent` and `hybridrl.fork_at` for a fork, the
run's validation metrics at that step (`val.*`), and after an evaluation its `eval.*`
metrics and `hybridrl.promotion`.
"""

from __future__ import annotations

import logging
from typing import Any

from hybrid_engine.config import HybridConfig
from storage.store import RunStore
from storage.tracking.tracker import client_for, tracking_uri, usable_uri

log = logging.getLogger("hybridrl.registry")
CHAMPION = "champion"


def register(
    cfg: HybridConfig,
    store: RunStore,
    policy_dir: str,
    step: int,
    source: str,
    metrics: dict[str, Any],
) -> Any:
    """Log `policy_dir` (model + tokenizer) to the run's MLflow run and register it; returns
    the ModelVersion."""
    import mlflow

    doc = store.read_run() or {}
    run_id = doc.get("mlflow_run_id")
    if run_id is None:
        raise LookupError(f"run {store.run_id} has no MLflow run (tracking.enabled was false)")
    uri = usable_uri(doc.get("mlflow_tracking_uri") or tracking_uri(cfg))
    mlflow.set_tracking_uri(uri)
    name = cfg.registry.model_name
    from importlib.metadata import version as package_version

    # given, not inferred: inferring loads the model again in a child process to see its imports
    requirements = [f"{p}=={package_version(p)}" for p in ("torch", "transformers", "safetensors")]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the components, not the directory: MLflow 3.17's local-checkpoint path fails with
    # transformers 5 (it reads a pipeline class name that is now a string)
    components = {
        "model": AutoModelForCausalLM.from_pretrained(policy_dir),
        "tokenizer": AutoTokenizer.from_pretrained(policy_dir),
    }
    with mlflow.start_run(run_id=run_id):
        info = mlflow.transformers.log_model(
            transformers_model=components,
            name=f"policy-{source.replace('/', '-')}",
            task="text-generation",
            registered_model_name=name,
            pip_requirements=requirements,
        )
    client = client_for(uri)
    version = info.registered_model_version
    tags = {
        "hybridrl.run_id": store.run_id,
        "hybridrl.step": str(step),
        "hybridrl.storage_uri": store.url,
        "hybridrl.source": source,
    }
    if lineage := doc.get("lineage"):
        tags |= {"hybridrl.parent": lineage["parent"], "hybridrl.fork_at": lineage["at"]}
    tags |= {
        f"{k.replace('/', '.')}": f"{v:.6g}"
        for k, v in metrics.items()
        if k.startswith("val/") and isinstance(v, int | float)
    }
    for key, value in tags.items():
        client.set_model_version_tag(name, str(version), key, value)
    return client.get_model_version(name, str(version))


def load(uri: str, tracking: str | None = None) -> Any:
    """A registered policy back as a text-generation pipeline (`models:/NAME/VERSION`,
    `models:/NAME@champion`) from the registry at `tracking` (default: MLflow's own)."""
    import mlflow

    if tracking:
        mlflow.set_tracking_uri(tracking)
    return mlflow.transformers.load_model(uri)


def champion(client: Any, name: str) -> Any | None:
    """The version holding the alias `champion` (None when no version holds it)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def sanity(metrics: dict[str, float], best: dict[str, float] | None, c: Any) -> list[str]:
    """What is wrong with a version's responses (empty: nothing): too few in the expected
    format, lengths collapsed or exploded (against the champion's, when there is one, and
    the share cut at the token limit)."""
    problems = []
    if metrics["eval/format_rate"] < c.min_format_rate:
        problems.append(
            f"format kept in {metrics['eval/format_rate']:.2f} of responses "
            f"< registry.min_format_rate={c.min_format_rate}"
        )
    length = metrics["eval/response_length/mean"]
    if length < 1.0:
        problems.append("responses collapsed to nothing (mean length < 1 token)")
    if metrics["eval/clip_ratio"] > c.max_clip_ratio:
        problems.append(
            f"{metrics['eval/clip_ratio']:.2f} of responses cut at the token limit "
            f"> registry.max_clip_ratio={c.max_clip_ratio}"
        )
    if best and (ref := best.get("eval/response_length/mean")):
        ratio = length / ref
        if not c.min_length_ratio <= ratio <= c.max_length_ratio:
            problems.append(
                f"mean length {length:.1f} is {ratio:.2f}x the champion's {ref:.1f} "
                f"(allowed {c.min_length_ratio}-{c.max_length_ratio}x)"
            )
    return problems


def version_metrics(version: Any) -> dict[str, float]:
    """The `eval.*` tags of a version back as `eval/*` metrics."""
    return {
        k.replace("eval.", "eval/", 1): float(v)
        for k, v in version.tags.items()
        if k.startswith("eval.")
    }


def gate(
    client: Any, name: str, version: str, metrics: dict[str, float], c: Any
) -> tuple[bool, str]:
    """Record an evaluation on version `version` (tags `eval.*`) and decide its promotion:
    the alias `champion` when it passes `sanity` and its accuracy is at least the
    champion's + registry.promotion_margin (any accuracy when there is no champion yet);
    otherwise tag `hybridrl.promotion` with why not. Returns (promoted, why)."""
    for k, v in metrics.items():
        client.set_model_version_tag(name, version, k.replace("eval/", "eval.", 1), f"{v:.6g}")
    version = str(version)
    best = champion(client, name)
    if best is not None and str(best.version) == version:
        best = None  # the champion evaluated again keeps the alias if its responses pass
    best_metrics = version_metrics(best) if best is not None else None
    problems = sanity(metrics, best_metrics, c)
    acc = metrics["eval/accuracy"]
    if best_metrics is not None and "eval/accuracy" in best_metrics:
        need = best_metrics["eval/accuracy"] + c.promotion_margin
        if acc < need:
            problems.append(
                f"accuracy {acc:.3f} < champion v{best.version}'s "
                f"{best_metrics['eval/accuracy']:.3f} + margin {c.promotion_margin}"
            )
    if problems:
        why = "not promoted: " + "; ".join(problems)
        client.set_model_version_tag(name, version, "hybridrl.promotion", why)
        return False, why
    before = f" (was v{best.version})" if best is not None else ""
    why = f"champion: accuracy {acc:.3f}{before}"
    client.set_registered_model_alias(name, CHAMPION, version)
    client.set_model_version_tag(name, version, "hybridrl.promotion", why)
    return True, why
