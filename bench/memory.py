"""Peak memory per worker: hybrid layout vs a separate rollout copy; and resharding cost.

    python bench/memory.py [--model smollm2-135m-instruct] [--steps 2] [--ranks 1 2]
                           [--layouts hybrid,separate] [overrides...]

For each rank count and layout, a fresh pool (new worker processes, so peak RSS starts
clean) runs the same GRPO steps (same batch), then every worker's peak RSS is read.
- hybrid: 1 rank = the rollout module is the training module (zero copy); FSDP = weights are
  gathered into the rollout module before generation and released after it.
- separate copy: a full rollout copy of the weights is kept (and refreshed after updates).
Resharding cost = `timing_s/reshard` of the steps after the first update (seconds per sync).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

# A head of the benchmark's own: stopping it never touches the user's pools.
os.environ.setdefault("HYBRIDRL_RAY_STATE", os.path.join(tempfile.gettempdir(), "hrl-bench-ray"))

from hybrid_engine.config import load_config  # noqa: E402
from hybrid_engine.engine import Engine  # noqa: E402
from hybrid_engine.pool.pool import stop_local_head  # noqa: E402


def run(model: str, ranks: int, separate: bool, steps: int, overrides: list[str]) -> dict:
    cfg = load_config(
        "configs/demo_cpu.yaml",
        [
            f"model.path={model}",
            "trainer.backend=ray",
            f"ray.pool_name=bench-mem-{ranks}",
            f"actor.layout.dp={ranks}",
            f"actor.layout.rollout.separate_copy={separate}",
            "data.train_batch_size=4",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=16",
            "actor.ppo_micro_batch_size=4",
            "rollout.micro_batch_size=8",
            "trainer.num_threads=1",
            *overrides,
        ],
    )
    engine = Engine(cfg)
    history = [engine.step(s) for s in range(1, steps + 1)]
    workers = engine.pool.status()
    engine.pool.down(stop_head=False)
    return {
        "peak": [w["peak_rss_gb"] for w in workers],
        "reshard": [h["timing_s/reshard"] for h in history[1:]],
        "gen": statistics.median(h["timing_s/gen"] for h in history),
        "step": statistics.median(h["timing_s/step"] for h in history),
        "params": [w["actor"]["local_params"] for w in workers],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layouts", default="hybrid,separate")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. ray.worker_env={...}")
    args = ap.parse_args()
    rows = []
    try:
        for ranks in args.ranks:
            for layout in args.layouts.split(","):
                separate = {"hybrid": False, "separate": True}[layout]
                r = run(args.model, ranks, separate, args.steps, args.overrides)
                rows.append((ranks, layout, r))
                print(
                    f"ranks={ranks} {layout:13s} peak RSS/worker GB: "
                    f"{', '.join(f'{p:.2f}' for p in r['peak'])}  "
                    f"params/rank: {', '.join(f'{p / 1e6:.1f}M' for p in r['params'])}  "
                    f"reshard s/sync: {', '.join(f'{s:.3f}' for s in r['reshard']) or '-'}  "
                    f"gen {r['gen']:.1f} s  step {r['step']:.1f} s",
                    flush=True,
                )
    finally:
        stop_local_head()
    print("\n| ranks | layout | peak RSS per worker (GB) | reshard s per sync (median) |")
    print("| --- | --- | --- | --- |")
    for ranks, layout, r in rows:
        med = f"{statistics.median(r['reshard']):.3f}" if r["reshard"] else "-"
        print(f"| {ranks} | {layout} | {max(r['peak']):.2f} | {med} |")


if __name__ == "__main__":
    main()
