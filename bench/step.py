"""Seconds per stage of demo steps (SmolLM2-135M, the demo preset) and peak RSS.

.venv/bin/python bench/step.py [--steps 3] [overrides...]
"""

from __future__ import annotations

import argparse

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.step_metrics import peak_rss_gb

STAGES = [
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "step",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config("configs/demo_cpu.yaml", args.overrides)
    engine = Engine(cfg)
    print(
        f"{cfg.data.train_batch_size} prompts x {cfg.rollout.n} samples, "
        f"{cfg.rollout.max_new_tokens} new tokens, one-update shortcut: "
        f"{engine.cfg.on_policy_single_update}"
    )
    header = " ".join(f"{s:>13}" for s in STAGES)
    print(f"{'step':>4} {header} {'resp_len':>8} {'gen tok/s':>9}")
    for step in range(1, args.steps + 1):
        m = engine.step(step)
        cells = " ".join(f"{m.get(f'timing_s/{s}', float('nan')):13.2f}" for s in STAGES)
        print(
            f"{step:>4} {cells} {m['response_length/mean']:8.1f} "
            f"{m['perf/tokens_per_s_rollout']:9.1f}"
        )
    print(f"peak RSS: {peak_rss_gb():.2f} GB")


if __name__ == "__main__":
    main()
