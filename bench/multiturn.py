"""Multi-turn rollout cost: tokens/s against a single-turn rollout of the same budget, the
share of the time spent in the environment, peak RSS.

.venv/bin/python bench/multiturn.py [--preset configs/multiturn_cpu.yaml] [--steps 2]
    [--out bench/results/multiturn.json] [overrides...]

Also the tool runner's own costs (a calculator call: the first, the next ones, the first
after a timeout). The same prompts (steps 1..N of the preset, SmolLM2, sampling) rolled out twice, in this
process, one after the other: multi-turn as the preset says, then single-turn with
`max_new_tokens = max_turns x rollout.max_new_tokens` (the policy's token budget of a
trajectory). Tokens/s counts the policy's sampled tokens per second of rollout wall time;
observation tokens are prefilled, not sampled, and are reported beside them. With the `hf`
prefix cache, the share of context tokens taken from it. To measure other code with this
script: `PYTHONPATH=<its checkout> .venv/bin/python bench/multiturn.py`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from report import cpu_model  # beside this file

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.step_metrics import peak_rss_gb


def measure(engine: Engine, steps: int) -> dict:
    tokens = obs = turns = rows = looked_up = hits = 0
    wall = gen = env = 0.0
    for step in range(1, steps + 1):
        start = time.perf_counter()
        batch = engine.rollout(step)
        wall += time.perf_counter() - start
        width = batch["response_mask"].shape[1]
        seen = int(batch["attention_mask"][:, -width:].sum())
        tokens += int(batch["response_mask"].sum())
        obs += seen - int(batch["response_mask"].sum())
        gen += batch.meta["gen_seconds"]
        env += batch.meta.get("env_seconds", 0.0)
        turns += sum(batch["turns"]) if "turns" in batch else len(batch)
        rows += len(batch)
        looked_up += batch.meta.get("prefix_lookup_tokens", 0)
        hits += batch.meta.get("prefix_hit_tokens", 0)
    return {
        "policy_tokens": tokens,
        "observation_tokens": obs,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "generate_share": gen / wall,
        "env_share": env / wall,
        "turns_per_sample": turns / rows,
        "samples": rows,
        # context tokens taken from the prefix cache (None: the code has no prefix cache)
        "prefix_cache_hit_rate": hits / looked_up if looked_up else None,
        "peak_rss_gb": peak_rss_gb(),  # of the process so far
    }


def tool_call_costs(calls: int = 200) -> dict:
    """The tool runner alone: first call (child start + import), then per call, then the
    first call after a timeout killed the child."""
    from hybrid_engine.rollout.envs.tool_runner import ToolRunner

    calc, args = (
        "hybrid_engine.rollout.envs.builtin_tools:calculator",
        {"expression": "123 * (45 - 6)"},
    )
    runner = ToolRunner()
    start = time.perf_counter()
    runner.call(calc, args, 5.0, 2000)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(calls):
        runner.call(calc, args, 5.0, 2000)
    per_call = (time.perf_counter() - start) / calls
    start = time.perf_counter()
    runner.call(calc, {"expression": "9 ** 9 ** 9"}, 0.5, 2000)  # killed at 0.5 s
    runner.call(calc, args, 5.0, 2000)
    after_kill = time.perf_counter() - start - 0.5
    runner.close()
    return {"first_call_s": first, "per_call_s": per_call, "restart_after_kill_s": after_kill}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="configs/multiturn_cpu.yaml")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="bench/results/multiturn.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.preset, args.overrides)
    mt = cfg.rollout.multi_turn
    engine = Engine(cfg)
    multi = measure(engine, args.steps)
    budget = mt.max_turns * cfg.rollout.max_new_tokens
    engine.cfg = load_config(
        args.preset,
        [*args.overrides, "rollout.multi_turn.enabled=false", f"rollout.max_new_tokens={budget}"],
    )
    single = measure(engine, args.steps)
    result = {
        "cpu": cpu_model(),
        "preset": args.preset,
        "overrides": args.overrides,
        "environment": mt.environment,
        "max_turns": mt.max_turns,
        "max_new_tokens_per_turn": cfg.rollout.max_new_tokens,
        "single_turn_max_new_tokens": budget,
        "multi_turn": multi,
        "single_turn": single,
        "peak_rss_gb": peak_rss_gb(),
        "tool_runner": tool_call_costs(),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(
        f"{result['cpu']}, {mt.environment}, {args.steps} steps x {multi['samples'] // args.steps} samples"
    )
    for name, r in (("multi-turn", multi), ("single-turn", single)):
        print(
            f"  {name:11s}: {r['policy_tokens']} policy tokens (+{r['observation_tokens']} "
            f"observation) in {r['wall_s']:.1f} s = {r['tokens_per_s']:.0f} tokens/s; "
            f"{r['turns_per_sample']:.2f} turns/sample; generate {100 * r['generate_share']:.0f}%, "
            f"environment {100 * r['env_share']:.2f}% of the wall time"
        )
    rate = multi["prefix_cache_hit_rate"]
    print(
        f"  prefix cache hit rate (multi-turn): {'none' if rate is None else f'{100 * rate:.1f}%'}"
        f"; peak RSS after multi-turn {multi['peak_rss_gb']:.2f} GB, at the end "
        f"{result['peak_rss_gb']:.2f} GB"
    )
    t = result["tool_runner"]
    print(
        f"  tool runner: first call {1000 * t['first_call_s']:.0f} ms, then "
        f"{1000 * t['per_call_s']:.2f} ms per call; after a timeout kill "
        f"{1000 * t['restart_after_kill_s']:.0f} ms to the next answer"
    )


if __name__ == "__main__":
    main()
