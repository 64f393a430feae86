"""Rollout speed: hybridrl's `hf` backend vs plain `model.generate`, same prompts and batch.

    .venv/bin/python bench/rollout.py [--prompts 8] [--n 4] [--max-new-tokens 32] [--repeats 2]

Prints completion tokens per second for both (sampling at temperature 1.0, SmolLM2-135M).
"""

from __future__ import annotations

import argparse
import time

import torch

from hybrid_engine.config import load_config
from hybrid_engine.data import PromptData, prompt_batch
from hybrid_engine.models import load_policy, load_tokenizer
from hybrid_engine.rollout import HFRollout, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    cfg = load_config("configs/demo_cpu.yaml")
    tok = load_tokenizer(cfg.model)
    model = load_policy(cfg.model, tok, seed=0)
    rows = PromptData(cfg.data).step_rows(1)[: args.prompts]
    batch = prompt_batch(rows, tok, 256).repeat_interleave(args.n)
    ours = HFRollout(model, tok.pad_token_id, tok.eos_token_id, micro_batch_size=len(batch))
    print(f"torch threads: {torch.get_num_threads()}, batch {len(batch)} sequences, "
          f"{args.max_new_tokens} new tokens, temperature 1.0")  # fmt: skip
    for r in range(args.repeats):
        sp = SamplingParams(args.max_new_tokens, 1.0, seed=r)
        out = ours.generate(batch, sp)
        ours_tps = out.meta["gen_tokens_per_s"]

        torch.manual_seed(r)
        start = time.perf_counter()
        with torch.no_grad():
            seq = model.generate(
                input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"],
                max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            )  # fmt: skip
        secs = time.perf_counter() - start
        resp = seq[:, batch["prompt_ids"].shape[1] :]
        is_eos = (resp == tok.eos_token_id).long()
        plain_tokens = int(((is_eos.cumsum(-1) - is_eos) == 0).sum())
        print(f"repeat {r}: hybridrl hf {ours_tps:7.1f} tok/s ({out.meta['gen_tokens']} tokens) | "
              f"plain generate {plain_tokens / secs:7.1f} tok/s ({plain_tokens} tokens)")  # fmt: skip


if __name__ == "__main__":
    main()
