"""Prompt data: verl-style rows from reasoning-gym, a verifiers environment, or parquet/jsonl
files.

A row is a dict:
    prompt          list of chat messages [{"role": ..., "content": ...}]
    data_source     where it comes from ("reasoning_gym:basic_arithmetic", a file name, ...)
    reward_model    {"ground_truth": ...}
    extra_info      anything JSON (for reasoning-gym: the generator's entry, used by its scorer)

Batch N of training is a pure function of (train seed, N): epochs are reshuffled with
`Random(seed + epoch)`, so a resumed run sees exactly the prompts it would have seen.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from hybrid_engine.batch import Batch
from hybrid_engine.config import DataConfig
from hybrid_engine.verifiers_data import PREFIX as VF_PREFIX

RG_PREFIX = "reasoning_gym:"


def _json_safe(x: Any) -> Any:
    return json.loads(json.dumps(x, default=list))


def reasoning_gym_rows(
    task: str,
    size: int,
    seed: int,
    task_config: dict[str, Any],
    system_prompt: str | None,
    suffix: str,
) -> list[dict[str, Any]]:
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_config)
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"data.task_config={task_config!r} rejected by {task!r}: {e}") from None
    rows = []
    for entry in ds:
        content = entry["question"] + (f" {suffix}" if suffix else "")
        messages = [{"role": "user", "content": content}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        rows.append(
            {
                "prompt": messages,
                "data_source": RG_PREFIX + task,
                "reward_model": {"ground_truth": str(entry["answer"])},
                "extra_info": {"rg_entry": _json_safe(entry)},
            }
        )
    return rows


def file_rows(path: str) -> list[dict[str, Any]]:
    """verl-style rows from a .parquet or .jsonl file; each row is checked and named on error."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file {path!r} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(p).to_pylist()
    elif p.suffix in (".jsonl", ".json"):
        rows = []
        for i, line in enumerate(p.read_text().splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {i + 1} is not JSON: {e}") from None
    else:
        raise ValueError(f"data file {path!r}: expected .parquet or .jsonl")
    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        if not (isinstance(prompt, list) and prompt and all("content" in m for m in prompt)):
            raise ValueError(f"{path}: row {i} has no 'prompt' list of chat messages")
        gt = (row.get("reward_model") or {}).get("ground_truth")
        if gt is None:
            raise ValueError(f"{path}: row {i} has no reward_model.ground_truth")
        row.setdefault("data_source", p.name)
        row["extra_info"] = row.get("extra_info") or {}
    return rows


def load_rows(
    source: str, size: int, seed: int, cfg: DataConfig, split: str = "train"
) -> list[dict[str, Any]]:
    if source.startswith(RG_PREFIX):
        task = source.removeprefix(RG_PREFIX)
        return reasoning_gym_rows(
            task, size, seed, cfg.task_config, cfg.system_prompt, cfg.prompt_suffix
        )
    if source.startswith(VF_PREFIX):  # the [verifiers] extra
        from hybrid_engine.verifiers_data import verifiers_rows

        return verifiers_rows(source.removeprefix(VF_PREFIX), size, seed, cfg.task_config, split)
    return file_rows(source)


class PromptData:
    """Training rows, held-out validation rows, and deterministic step batches."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        self.train = load_rows(cfg.train_source, cfg.train_size, cfg.train_seed, cfg)
        source = cfg.val_source or cfg.train_source
        if cfg.val_source is not None or source.startswith((RG_PREFIX, VF_PREFIX)):
            val = load_rows(source, cfg.val_size, cfg.val_seed, cfg, "eval")
        else:
            val = []
        # A validation question that also occurs in training measures memory, not skill.
        seen = {_question(r) for r in self.train}
        self.val = [r for r in val if _question(r) not in seen]
        self.val_dropped = len(val) - len(self.val)
        if len(self.train) < cfg.train_batch_size:
            raise ValueError(
                f"data.train_batch_size={cfg.train_batch_size} exceeds the "
                f"{len(self.train)} training rows of {cfg.train_source!r}"
            )

    def step_indices(self, step: int) -> tuple[int, list[int]]:
        """(epoch, indices of the training rows) of batch `step` (1-based): batch g is
        the g-th slice of the data order, epoch e's order a shuffle by `train_seed + e`
        (the rows past the last full batch of an epoch are not used in it)."""
        bs, n = self.cfg.train_batch_size, len(self.train)
        per_epoch = n // bs
        epoch, k = divmod(step - 1, per_epoch)
        order = list(range(n))
        random.Random(self.cfg.train_seed + epoch).shuffle(order)
        return epoch, order[k * bs : (k + 1) * bs]

    def step_rows(self, step: int) -> list[dict[str, Any]]:
        """Prompt rows of training step `step` (1-based)."""
        return [self.train[i] for i in self.step_indices(step)[1]]


def _question(row: dict[str, Any]) -> str:
    return json.dumps(row["prompt"], sort_keys=True)


def prompt_batch(
    rows: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, max_prompt_length: int
) -> Batch:
    """Chat-templated, left-padded prompt tokens plus the rows' fields, one sample per row."""
    ids = []
    for i, row in enumerate(rows):
        tok = tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True
        )
        if hasattr(tok, "keys"):
            tok = tok["input_ids"]
        if len(tok) > max_prompt_length:
            raise ValueError(
                f"prompt of row {i} ({row['data_source']}) has {len(tok)} tokens, more than "
                f"data.max_prompt_length={max_prompt_length}"
            )
        ids.append(list(tok))
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return Batch(
        {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask},
        {
            "prompt": [r["prompt"] for r in rows],
            "data_source": [r["data_source"] for r in rows],
            "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
            "extra_info": [r["extra_info"] for r in rows],
        },
    )
