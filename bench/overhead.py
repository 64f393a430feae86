"""Orchestration overhead: seconds per step through Prefect + storage (+ the Ray pool) vs the
engine's plain in-process loop, on the same config and seed (so every variant computes the
same steps: step N is compared with step N).

.venv/bin/python bench/overhead.py [--steps 3] [--config configs/demo_cpu.yaml]
                                   [--variants loop,flow-local,flow-ray] [overrides...]

Each variant runs in its own process. "step" = rollout -> reward -> advantage -> update as
the driver sees it (validation and checkpoints excluded, as in the loop). Prints a table and
the overhead of each flow variant over the loop, per step and in median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("loop", "flow-local", "flow-ray")


def run_variant(variant: str, config: str, steps: int, overrides: list[str]) -> dict:
    """Inside the child process: run and return {step: seconds} plus context."""
    common = [f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
              "trainer.test_freq=0", *overrides]  # fmt: skip
    began = time.perf_counter()
    if variant == "loop":
        from hybrid_engine.config import load_config
        from hybrid_engine.trainer import Engine

        engine = Engine(load_config(config, common))
        ready = time.perf_counter() - began
        walls = {s: engine.step(s)["timing_s/step"] for s in range(1, steps + 1)}
        return {"step_s": walls, "startup_s": ready, "total_s": time.perf_counter() - began}
    from flows.train import train

    root = tempfile.mkdtemp(prefix="hybridrl-bench-")
    extra = [f"storage.root={root}"]
    if variant == "flow-ray":
        extra += ["trainer.backend=ray", f"ray.pool_name=bench-{os.getpid()}"]
    result = train(config=config, overrides=common + extra, run_id="bench")
    total = time.perf_counter() - began
    if variant == "flow-ray":
        from hybrid_engine.pool import down

        down(f"bench-{os.getpid()}")
    walls = {int(k): v for k, v in result["step_wall_s"].items()}
    return {"step_s": walls, "total_s": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--config", default="configs/demo_cpu.yaml")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.child:
        out = run_variant(args.child, args.config, args.steps, args.overrides)
        print("RESULT " + json.dumps(out))
        return

    results = {}
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--child", variant, "--steps", str(args.steps),
               "--config", args.config, *args.overrides]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"{variant} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                     f"{proc.stderr[-3000:]}")  # fmt: skip
        results[variant] = json.loads(line[0].removeprefix("RESULT "))
        steps = results[variant]["step_s"]
        print(f"{variant:>10}: " + "  ".join(f"{float(v):6.2f}" for v in steps.values())
              + f"   (process total {results[variant]['total_s']:.1f} s)", flush=True)  # fmt: skip

    base = results.get("loop")
    print(f"\n{'variant':>10} {'median s/step':>14} {'overhead s':>11} {'overhead %':>11}")
    for variant, r in results.items():
        med = statistics.median(float(v) for v in r["step_s"].values())
        if base is None or variant == "loop":
            print(f"{variant:>10} {med:14.3f}")
            continue
        diffs = [float(r["step_s"][s]) - float(base["step_s"][s]) for s in base["step_s"]]
        over = statistics.median(diffs)
        ref = statistics.median(float(v) for v in base["step_s"].values())
        print(f"{variant:>10} {med:14.3f} {over:11.3f} {100 * over / ref:10.1f}%")


if __name__ == "__main__":
    main()
