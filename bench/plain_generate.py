"""The rollout benchmarks' baseline: plain `transformers` sampling on the same batch
(`bench/rollout.py`, `bench/vs_trl.py`, `bench/gpu_check.py`)."""

from __future__ import annotations

import time

import torch


def plain_generate(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    new_tokens: int,
    eos: int,
    pad: int,
    seed: int,
) -> tuple[int, float]:
    """`model.generate` at temperature 1 over the whole vocabulary (no top-p or top-k), from
    the prompts `ids` seeded by `seed`: (response tokens through the first `eos`, seconds)."""
    from hybrid_engine.rollout.base import response_mask_from_ids

    sync = torch.cuda.synchronize if ids.is_cuda else lambda: None
    torch.manual_seed(seed)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        seq = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad,
            eos_token_id=eos,
        )
    sync()
    seconds = time.perf_counter() - start
    return int(response_mask_from_ids(seq[:, ids.shape[1] :], eos).sum()), seconds
