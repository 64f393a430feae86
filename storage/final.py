"""The end of a run: `<root>/<run_id>/final/` holds the trained policy (Hugging Face
safetensors + tokenizer) and `summary.json` (resolved config, per-step metrics), committed
like a stage. A LoRA run's policy there has the adapters merged in, and `final/adapter/`
holds the adapter alone as peft saves it (`PeftModel.from_pretrained(base, "final/adapter")`)."""

from __future__ import annotations

import json
import logging
import tempfile
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybrid_engine.config import HybridConfig, redact
from hybrid_engine.export import adapter_files
from storage.store import RunStore

FINAL = "final"
log = logging.getLogger("hybridrl.storage")


def history(store: RunStore, total_steps: int) -> list[dict[str, Any]]:
    """Per-step metrics from the committed stages: {step, update metrics, validation}.

    A step whose update record was corrupted after a later checkpoint was taken cannot be
    recomputed (the weights it started from are gone); its weights live on in that
    checkpoint, its metrics are lost: the row says so under `lost` (and the step counts)."""
    rows = []
    for step in range(total_steps + 1):
        row: dict[str, Any] = {}
        for stage in ("update", "validate"):
            got = store.load_stage(step, stage)
            if got is not None:
                row |= got.meta["metrics"]
            elif stage == "update" and store.marker(store.stage_dir(step, stage)) is not None:
                row["lost"] = (
                    f"steps/{step}/update is corrupted: the weights it made are kept "
                    "(later checkpoints hold them), its metrics are lost"
                )
                log.warning("step %d: %s", step, row["lost"])
        if row:
            rows.append({"step": step, **row})
    return rows


def save_final(
    store: RunStore,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: HybridConfig,
    rows: list[dict[str, Any]],
    adapter_state: dict[str, Any] | None = None,
) -> str:
    """Write and commit `final/` (model, tokenizer, summary.json, and `adapter/` from the
    adapter tensors of `adapter_state`); returns its URI."""
    summary = {
        "run_id": store.run_id,
        "config": redact(cfg.model_dump(mode="json")),
        "steps": len([h for h in rows if h.get("step", 0) > 0]),
        "last_step_metrics": rows[-1] if rows else {},
        "history": rows,
    }
    with tempfile.TemporaryDirectory(prefix="hybridrl-final-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if adapter_state is not None:
            adapter_files(f"{tmp}/adapter", adapter_state, cfg.actor.lora, cfg.model.path)
        with open(f"{tmp}/summary.json", "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
        files = store.put_dir(tmp, FINAL)
    return store.commit(FINAL, files, {"steps": summary["steps"]})
