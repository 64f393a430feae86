"""The end of a run: the trained policy as Hugging Face safetensors + tokenizer, and
`summary.json` (resolved config and the last step's metrics) beside it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybrid_engine.config import HybridConfig


def save_final(
    run_dir: str | Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: HybridConfig,
    history: list[dict[str, Any]],
) -> Path:
    """Write `<run_dir>/final/` (model, tokenizer, summary.json); returns that folder."""
    final = Path(run_dir) / "final"
    final.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(final, safe_serialization=True)
    tokenizer.save_pretrained(final)
    summary = {
        "config": cfg.model_dump(mode="json"),
        "steps": len([h for h in history if h.get("step", 0) > 0]),
        "last_step_metrics": history[-1] if history else {},
        "history": history,
    }
    tmp = final / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True))
    os.replace(tmp, final / "summary.json")
    return final
