"""Supervised warm-start: fine-tune the policy on demonstration conversations before RL.

RL learns a behaviour only once the policy samples it. SmolLM2-135M never writes a tool
call on its own, so no reward can teach it to; a few hundred demonstrations can:

    rows      the config's training rows (`data.*`)
    demos     `module:function(row) -> messages | None`: the conversation to imitate
    ids       each conversation in the chat template, the assistant's replies (and the end
              token closing each) trained, everything else context - the same tokens an
              agent episode records, so RL continues from what was imitated
    update    AdamW on the mean cross-entropy of the trained tokens, `epochs` passes
    out       a Hugging Face directory: `model.path=<out>` starts a run from it

Deterministic: the same seed gives the same weights.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hybrid_engine.config import HybridConfig
from hybrid_engine.data import load_rows
from hybrid_engine.models.loading import load_policy, load_tokenizer
from hybrid_engine.rollout.multiturn import encode, render
from hybrid_engine.specs import load_spec


def demonstration_ids(
    tokenizer: Any, messages: list[dict[str, Any]]
) -> tuple[list[int], list[int]]:
    """(token ids, 1 on the assistant's own tokens) of a conversation. Each assistant reply
    is encoded alone and closed by the end token, as a sampled reply is."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise ValueError(f"message {k}: needs a role")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"message {k}: needs text content")
        if m["role"] != "assistant":
            continue
        head = render(tokenizer, messages[:k], None, True)
        if not head.startswith(done):
            raise ValueError(
                f"message {k}: the chat template renders the earlier turns differently once "
                "this one is added, so the conversation is not one token sequence"
            )
        context = encode(tokenizer, head[len(done) :])
        reply = encode(tokenizer, m["content"]) + [tokenizer.eos_token_id]
        ids += context + reply
        mask += [0] * len(context) + [1] * len(reply)
        done = head + m["content"] + tokenizer.eos_token
    if not any(mask):
        raise ValueError("the conversation has no assistant message to imitate")
    return ids, mask


def demonstrations(cfg: HybridConfig, demos: str, limit: int) -> list[tuple[list[int], list[int]]]:
    """Tokenized demonstrations of the first `limit` training rows that have one."""
    make = load_spec(demos, "--demos")
    tokenizer = load_tokenizer(cfg.model)
    rows = load_rows(cfg.data.train_source, cfg.data.train_size, cfg.data.train_seed, cfg.data)
    out = []
    for i, row in enumerate(rows):
        if len(out) == limit:
            break
        messages = make(row)
        if messages is None:
            continue
        try:
            out.append(demonstration_ids(tokenizer, messages))
        except (KeyError, TypeError, ValueError) as e:  # the demos function's or ours
            raise ValueError(f"{demos} on training row {i}: {e}") from None
    if not out:
        raise ValueError(f"{demos} gave no demonstration for the {len(rows)} training rows")
    return out


def _batch(items: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), width), pad)
    seen = torch.zeros((len(items), width), dtype=torch.long)
    labels = torch.full((len(items), width), -100)
    for r, (row_ids, row_mask) in enumerate(items):
        n = len(row_ids)
        ids[r, :n] = torch.tensor(row_ids)
        seen[r, :n] = 1
        labels[r, :n] = torch.where(torch.tensor(row_mask) == 1, torch.tensor(row_ids), -100)
    return ids, seen, labels


def warm_start(
    cfg: HybridConfig,
    demos: str,
    out: str | Path,
    examples: int = 64,
    epochs: int = 1,
    lr: float = 1e-5,
    batch_size: int = 8,
    on_step: Callable[[int, int, float], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune `cfg.model` on the demonstrations `demos` makes of the training rows and
    save it to `out` (written whole or not at all). Returns what was done, also saved as
    `out/warmstart.json`."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"--out {str(out)!r} exists; name a new directory")
    started = time.monotonic()
    items = demonstrations(cfg, demos, examples)
    seed = cfg.trainer.seed
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(cfg.model)
    model = load_policy(cfg.model, tokenizer, seed)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    per_epoch = -(-len(items) // batch_size)
    total, losses = per_epoch * epochs, []
    for epoch in range(epochs):
        order = list(range(len(items)))
        random.Random(seed + epoch).shuffle(order)
        for b in range(per_epoch):
            ids, seen, labels = _batch(
                [items[i] for i in order[b * batch_size : (b + 1) * batch_size]],
                tokenizer.pad_token_id,
            )
            # the head only where a token is trained: most of a conversation is context
            hidden = model.base_model(input_ids=ids, attention_mask=seen).last_hidden_state
            trained = labels[:, 1:] != -100
            logits = model.get_output_embeddings()(hidden[:, :-1][trained])
            loss = F.cross_entropy(logits, labels[:, 1:][trained])
            optim.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            losses.append(round(loss.item(), 4))
            if on_step is not None:
                on_step(len(losses), total, losses[-1])
    summary = {
        "demos": demos,
        "model": cfg.model.path,
        "examples": len(items),
        "trained_tokens": sum(sum(m) for _, m in items),
        "epochs": epochs,
        "lr": lr,
        "batch_size": batch_size,
        "seed": seed,
        "losses": losses,
        "seconds": round(time.monotonic() - started, 1),
    }
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "warmstart.json").write_text(json.dumps(summary, indent=1) + "\n")
    partial.rename(out)
    return summary
