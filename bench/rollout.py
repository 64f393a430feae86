"""Rollout speed: hybridrl's `hf` backend vs plain `model.generate` (and with `--vllm` the
`vllm` backend), and this machine's floor.

    .venv/bin/python bench/rollout.py [--prompts 8] [--n 4] [--max-new-tokens 32] [--repeats 2]
                                      [--vllm [--vllm-compiled]] [--equal-work]

Prints completion tokens per second for each (sampling at temperature 1.0, SmolLM2-135M), and
the floor of any decoder here: a decode step must run every weight matrix of the model once
(all `nn.Linear` layers, LM head included) for the whole batch. Timed alone, those matmuls
give the most tokens/s any implementation can reach at this batch without changing the
work (no draft model, no quantisation). `--equal-work`: no row stops early (the stop token
is an id the model never samples), so every backend decodes the same rows x tokens.
`--vllm` needs the vLLM environment (`scripts/setup_vllm.sh`); its engine starts after the
others ran (its idle threads would share their cores), and its first round (warm-up) is
reported apart. `--vllm-compiled`: then an engine with `rollout.vllm.compile=true` too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from plain_generate import plain_generate  # beside this file

from hybrid_engine.config import load_config
from hybrid_engine.data import PromptData, prompt_batch
from hybrid_engine.models.loading import load_policy, load_tokenizer
from hybrid_engine.rollout.base import SamplingParams
from hybrid_engine.rollout.hf import HFRollout


@torch.no_grad()
def decode_step_matmuls_s(model: torch.nn.Module, rows: int, repeats: int = 7) -> float:
    """Median seconds of one pass over every Linear layer at `rows` rows (one decode step's
    matmuls, each weight read once)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {n: torch.randn(rows, n) for n in {m.in_features for m in linears}}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for m in linears:
            m(inputs[m.in_features])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="also the vllm backend")
    ap.add_argument(
        "--vllm-compiled", action="store_true", help="with --vllm: also rollout.vllm.compile=true"
    )
    ap.add_argument("--equal-work", action="store_true", help="every row max-new-tokens long")
    args = ap.parse_args()
    cfg = load_config("configs/demo_cpu.yaml")
    tok = load_tokenizer(cfg.model)
    model = load_policy(cfg.model, tok, seed=0).eval()
    rows = PromptData(cfg.data).step_rows(1)[: args.prompts]
    prompts = prompt_batch(rows, tok, 256)
    batch = prompts.repeat_interleave(args.n)
    eos = len(tok) if args.equal_work else tok.eos_token_id  # len(tok): never sampled
    ours = HFRollout(model, tok.pad_token_id, eos, micro_batch_size=len(batch))
    print(
        f"torch threads: {torch.get_num_threads()}, batch {len(batch)} sequences, "
        f"{args.max_new_tokens} new tokens, temperature 1.0"
    )
    ours_tps, plain_tps, steps, tokens = [], [], [], []
    for r in range(args.repeats):
        sp = SamplingParams(args.max_new_tokens, 1.0, seed=r)
        out = ours.generate(batch, sp)
        ours_tps.append(out.meta["gen_tokens_per_s"])
        steps.append(out["response_ids"].shape[1])
        tokens.append(out.meta["gen_tokens"])

        ids, mask = batch["prompt_ids"], batch["prompt_mask"]
        plain_tokens, secs = plain_generate(
            model, ids, mask, args.max_new_tokens, eos, tok.pad_token_id, seed=r
        )
        plain_tps.append(plain_tokens / secs)
        print(
            f"repeat {r}: hybridrl hf {ours_tps[-1]:7.1f} tok/s ({out.meta['gen_tokens']} "
            f"tokens, {steps[-1]} steps) | plain generate {plain_tps[-1]:7.1f} tok/s "
            f"({plain_tokens} tokens)"
        )

    # The floor: one step's matmuls per decode step, plus the distinct prompts' prefill.
    step_s = decode_step_matmuls_s(model, len(batch))
    with torch.no_grad():
        start = time.perf_counter()
        model(
            input_ids=prompts["prompt_ids"], attention_mask=prompts["prompt_mask"], logits_to_keep=1
        )
        prefill_s = time.perf_counter() - start
    best = statistics.median(
        k / (prefill_s + n * step_s) for k, n in zip(tokens, steps, strict=True)
    )
    plain = statistics.median(plain_tps)
    print(
        f"median: hybridrl {statistics.median(ours_tps):.1f} tok/s, plain generate "
        f"{plain:.1f} tok/s, ratio {statistics.median(ours_tps) / plain:.2f}x"
    )
    print(
        f"floor: one decode step's matmuls {1000 * step_s:.0f} ms at {len(batch)} rows "
        f"(weights {sum(p.numel() for p in model.parameters()) * 4 / 1e6:.0f} MB read per "
        f"step), prefill of the {len(prompts)} distinct prompts {prefill_s:.2f} s: at best "
        f"{best:.0f} tok/s = {best / plain:.2f}x plain generate"
    )
    if args.vllm:
        for compiled in (False, True) if args.vllm_compiled else (False,):
            hf = statistics.median(ours_tps)
            vllm_rounds(model, tok, batch, eos, args, plain, hf, compiled)


def vllm_rounds(model, tok, batch, eos, args, plain: float, hf: float, compiled: bool) -> None:
    """The vllm backend on the same batch: a warm-up round, then `repeats` timed rounds.
    Starts (and afterwards stops) a local Ray head of its own unless one is running."""
    import ray

    from hybrid_engine.pool import cluster
    from hybrid_engine.rollout.vllm import VLLMRollout, strip_left_padding, vllm_sampling_kwargs

    had_head = (cluster.state_dir() / "head.json").is_file()
    mode = "compiled" if compiled else "eager"
    vcfg = load_config(
        "configs/demo_cpu.yaml", ["rollout.name=vllm", f"rollout.vllm.compile={compiled}"]
    )
    start = time.perf_counter()
    engine = VLLMRollout.build(vcfg, model, tok)
    print(f"vllm ({mode}) engine up in {time.perf_counter() - start:.1f} s ({engine.info})")
    prompt_rows = strip_left_padding(batch["prompt_ids"], batch["prompt_mask"])
    try:
        tps = []
        for r in range(args.repeats + 1):
            sp = SamplingParams(args.max_new_tokens, 1.0, seed=r)
            params = vllm_sampling_kwargs(sp, tok.eos_token_id, 0, len(prompt_rows))
            if eos != tok.eos_token_id:  # equal work: vLLM refuses an out-of-vocabulary stop id
                for p in params:
                    p["min_tokens"] = args.max_new_tokens
            tokens, _, secs = ray.get(engine.actor.generate.remote(prompt_rows, params))
            n = sum(len(t) for t in tokens)
            tps.append(n / secs)
            name = "warm-up" if r == 0 else f"repeat {r - 1}"
            print(f"vllm ({mode}) {name}: {tps[-1]:7.1f} tok/s ({n} tokens)")
        med = statistics.median(tps[1:])
        print(
            f"median: vllm ({mode}) {med:.1f} tok/s = {med / plain:.2f}x plain generate, "
            f"{med / hf:.2f}x the hf backend"
        )
    finally:
        engine.close()
        if not had_head:
            cluster.stop_local_head()


if __name__ == "__main__":
    main()
