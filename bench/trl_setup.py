"""TRL 1.16's GRPOTrainer on a hybridrl preset's work: the one home of the TRL setup that
`bench/vs_trl.py` (speed) and `bench/learning.py` (learning) share.

Always forced equal to the preset: the model (its local folder, fp32 on CPU: `use_cpu`,
`bf16=False`), the prompts (the preset's training rows in hybridrl's step order,
`shuffle_dataset=False`, so that TRL's step k sees hybridrl's step k prompts), the reward
(hybridrl's scorer of the preset: `RewardScorer` on the completion text), the seed, and
per-step logs (`logging_steps=1`, `report_to="none"`, `save_strategy="no"`). Each caller
passes the rest as GRPOConfig fields; whatever it does not pass is TRL's default.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from typing import Any


def trl_trainer(
    cfg: Any,
    steps: int,
    settings: dict[str, Any],
    callbacks: list[Any],
    out_dir: str | None = None,
    wrap_model: Callable[[Any, Any], None] | None = None,
) -> Any:
    """A GRPOTrainer for `steps` optimizer steps of the preset `cfg` (a HybridConfig) with
    the GRPOConfig fields `settings`; `wrap_model(model, tokenizer)` may patch the model
    before the trainer takes it. The caller removes `out_dir` (a temporary one if None)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from hybrid_engine.data import PromptData
    from hybrid_engine.models.loading import load_tokenizer, resolve_model_path
    from hybrid_engine.rewards import RewardScorer

    data = PromptData(cfg.data)
    prompts_per_step = cfg.data.train_batch_size
    rows = [r for s in range(1, steps + 1) for r in data.step_rows(s)]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "row": json.dumps(r)} for r in rows])
    scorer = RewardScorer(cfg.reward.function, cfg.reward.answer_format, cfg.data.task_config)

    def reward(prompts, completions, row, **_):  # noqa: ANN001, ANN202
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return scorer.score([""] * len(texts), texts, [json.loads(r) for r in row])

    tokenizer = load_tokenizer(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(cfg.model.path), dtype=torch.float32
    )
    if wrap_model is not None:
        wrap_model(model, tokenizer)
    forced = {
        "output_dir": out_dir or tempfile.mkdtemp(prefix="trl-"),
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "shuffle_dataset": False,
        "max_steps": steps,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "seed": cfg.trainer.seed,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    args = GRPOConfig(**{**settings, **forced})
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    if per_step != prompts_per_step * args.num_generations:
        raise ValueError(
            f"TRL settings give {per_step} completions per step, the preset "
            f"{prompts_per_step} prompts x {args.num_generations}"
        )
    return GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
