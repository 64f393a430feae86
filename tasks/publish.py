"""Registering a run's policy in the MLflow Model Registry, and the Prefect events the train
flow emits for automations.

    register_final(cfg, store)        the `register` task: final/ as the next version of
                                      registry.model_name (once per run and step count)
    register_checkpoint(cfg, store, N)   checkpoint step_N's policy, on request
    announce(event, run_id, **payload)   a Prefect event on resource `hybridrl.run.<run_id>`:
                                      `hybridrl.checkpoint.committed`, `hybridrl.run.finished`
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from hybrid_engine.config import HybridConfig
from storage.final import FINAL, history
from storage.store import RunStore

log = logging.getLogger("hybridrl.registry")
# a run's config, run in this process (an asynchronous or pool run's policy evaluated here)
IN_PROCESS = ["trainer.backend=local", "trainer.max_staleness=0", "ray.rollout=colocated"]


def _registered(cfg: HybridConfig, store: RunStore, source: str, step: int) -> Any | None:
    """The version this run already registered from `source` at `step` (a resumed finished
    run must not register it twice)."""
    from storage.tracking.tracker import client_for

    doc = store.read_run() or {}
    client = client_for(doc.get("mlflow_tracking_uri"))
    for v in client.search_model_versions(f"run_id = '{doc.get('mlflow_run_id')}'"):
        if (
            v.name == cfg.registry.model_name
            and v.tags.get("hybridrl.source") == source
            and v.tags.get("hybridrl.step") == str(step)
        ):
            return v
    return None


@task(name="register", task_run_name="register", cache_policy=NONE, persist_result=False)
def register_final(cfg: HybridConfig, store: RunStore) -> dict[str, str] | None:
    """final/ as a model version (with its lineage and last validation metrics); None when
    tracking is off or registry.register_final is false."""
    if not (cfg.tracking.enabled and cfg.registry.register_final):
        return None
    rows = history(store, cfg.trainer.total_training_steps)
    step = rows[-1]["step"] if rows else 0
    version = _registered(cfg, store, FINAL, step)
    if version is None:
        from storage.tracking.model_registry import register

        metrics = {k: v for row in rows for k, v in row.items() if k.startswith("val/")}
        with tempfile.TemporaryDirectory(prefix="hybridrl-register-") as tmp:
            version = register(cfg, store, store.local_dir(FINAL, tmp), step, FINAL, metrics)
        log.info("registered %s as %s version %s", store.uri(FINAL), version.name, version.version)
    return {
        "model": f"{version.name}/{version.version}",
        "name": version.name,
        "version": str(version.version),
    }


def register_checkpoint(cfg: HybridConfig, store: RunStore, step: int) -> Any:
    """Checkpoint step_N's policy as a model version (`hybridrl register RUN --step N`)."""
    from hybrid_engine.config import config_from_dict
    from hybrid_engine.engine import Engine
    from storage.tracking.model_registry import register
    from tasks.checkpoint import load_checkpoint

    source = store.checkpoint_dir(step)
    if (version := _registered(cfg, store, source, step)) is not None:
        return version
    local = config_from_dict(
        store.read_run()["config"], [*IN_PROCESS, f"storage.root={store.cfg.root}"]
    )
    engine = Engine(local)
    if not load_checkpoint(engine, store, step):
        raise FileNotFoundError(f"run {store.run_id} has no usable checkpoint step_{step}")
    model, _ = engine.export()
    metrics = next((r for r in history(store, step) if r["step"] == step), {})
    with tempfile.TemporaryDirectory(prefix="hybridrl-register-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        engine.tokenizer.save_pretrained(tmp)
        return register(cfg, store, tmp, step, source, metrics)


def announce(event: str, about: str, labels: dict[str, str] | None = None, **payload: Any) -> None:
    """A Prefect event about run `about` (its run id); deployment triggers match on its
    resource labels (`hybridrl.registered: "true"` when the run registered a version)."""
    from prefect.events import emit_event

    resource = {"prefect.resource.id": f"hybridrl.run.{about}", "prefect.resource.name": about}
    emit_event(event=event, resource=resource | (labels or {}), payload=payload)
