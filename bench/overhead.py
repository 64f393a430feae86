"""Orchestration overhead: seconds per step through Prefect + storage (+ the Ray pool) vs the
engine's plain in-process loop, on the same config and seed (so every variant computes the
same steps: step N is compared with step N).

.venv/bin/python bench/overhead.py [--steps 3] [--repeat 2] [--config configs/demo_cpu.yaml]
                                   [--variants loop,flow-local,flow-ray] [overrides...]

Each variant runs in its own process, the variants alternating `--repeat` times (A B C A B
C ...). "step" = rollout -> reward -> advantage -> update as the driver sees it (validation
and checkpoints excluded, as in the loop). Per variant: median wall seconds per step, the
engine's own generation and actor-update seconds inside it, and the rest ("other": reward,
advantage, and for the flows Prefect task calls + storage reads/writes/commits).

The breakdown per step times the calls themselves in each child: the engine's four stage
calls ("engine"), the run store's stage loads and commits ("storage"), and after the step the
flow's step log (MLflow and the console line: "tracking"); "prefect" is the rest of the flow's
step wall (task submission, state API calls, result handling). Orchestration share = (storage
+ prefect + tracking) / (step wall + tracking).
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
STAGES = ("rollout", "reward", "advantage", "update")


class Spent:
    """Seconds per step spent in named calls, by kind (wraps the methods in this process)."""

    def __init__(self) -> None:
        self.step = 0
        self.by_step: dict[int, dict[str, float]] = {}

    def wrap(self, owner: type, name: str, kind: str, stage_arg: bool = False) -> None:
        fn = getattr(owner, name)

        def timed(obj, *args, **kwargs):
            if name == "rollout" or stage_arg:
                self.step = args[0]  # rollout(step, ...), load/commit_stage(step, stage, ...)
            if stage_arg and args[1] not in STAGES:  # validation, checkpoints: not a step's
                return fn(obj, *args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(obj, *args, **kwargs)
            finally:
                spent = self.by_step.setdefault(self.step, {})
                spent[kind] = spent.get(kind, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)


def instrument() -> Spent:
    """Time the engine's stage calls, the store's stage I/O and the flow's step log."""
    from hybrid_engine.engine import Engine

    spent = Spent()
    for name in STAGES:
        spent.wrap(Engine, name, "engine")
    try:
        from flows.tracking import StepLog
        from storage.store import RunStore
    except ImportError:  # an older checkout measured through PYTHONPATH
        return spent
    spent.wrap(RunStore, "load_stage", "storage", stage_arg=True)
    spent.wrap(RunStore, "commit_stage", "storage", stage_arg=True)
    spent.wrap(StepLog, "step", "tracking")
    return spent


def run_variant(variant: str, config: str, steps: int, overrides: list[str]) -> dict:
    """Inside the child process: run and return {step: seconds} plus context."""
    common = [
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        *overrides,
    ]
    began = time.perf_counter()
    spent = instrument()
    if variant == "loop":
        from hybrid_engine.config import load_config
        from hybrid_engine.engine import Engine

        engine = Engine(load_config(config, common))
        metrics = {s: engine.step(s) for s in range(1, steps + 1)}
        walls = {s: m["timing_s/step"] for s, m in metrics.items()}
        total = time.perf_counter() - began
        return {"step_s": walls, "metrics": metrics, "total_s": total, "spent": spent.by_step}
    from hybrid_engine.roles.workers import reuse_freed_memory

    reuse_freed_memory()  # as `hybridrl train` does before Prefect starts its threads
    from flows.train import train
    from hybrid_engine.config import StorageConfig
    from storage.final import history
    from storage.store import RunStore

    # each run writes ~2 GB of checkpoints: the folder goes whatever happens
    with tempfile.TemporaryDirectory(prefix="hybridrl-bench-") as root:
        extra = [f"storage.root={root}", f"tracking.uri=sqlite:///{root}/mlflow.db"]
        if variant == "flow-ray":
            extra += ["trainer.backend=ray", f"ray.pool_name=bench-{os.getpid()}"]
        result = train(config=config, overrides=common + extra, run_id="bench")
        total = time.perf_counter() - began
        if variant == "flow-ray":
            from hybrid_engine.pool.pool import down

            down(f"bench-{os.getpid()}")
        rows = history(RunStore(StorageConfig(root=root), "bench"), steps)
    metrics = {r["step"]: r for r in rows if r["step"] > 0}
    walls = {int(k): v for k, v in result["step_wall_s"].items()}
    return {"step_s": walls, "metrics": metrics, "total_s": total, "spent": spent.by_step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--config", default="configs/demo_cpu.yaml")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.child:
        out = run_variant(args.child, args.config, args.steps, args.overrides)
        print("RESULT " + json.dumps(out))
        return

    results: dict[str, list[dict]] = {v: [] for v in args.variants.split(",")}
    for rep in range(args.repeat):
        for variant in results:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                variant,
                "--steps",
                str(args.steps),
                "--config",
                args.config,
                *args.overrides,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(
                    f"{variant} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-3000:]}"
                )
            r = json.loads(line[0].removeprefix("RESULT "))
            results[variant].append(r)
            print(
                f"run {rep + 1} {variant:>10}: s/step "
                + "  ".join(f"{float(v):6.2f}" for v in r["step_s"].values())
                + f"   (process {r['total_s']:.1f} s)",
                flush=True,
            )

    def med(variant: str, key: str) -> float:
        vals = []
        for r in results[variant]:
            for s, wall in r["step_s"].items():
                m = r["metrics"][s]
                gen, upd = m.get("timing_s/gen", 0.0), m.get("timing_s/update_actor", 0.0)
                vals.append(
                    {"wall": wall, "gen": gen, "update": upd, "other": wall - gen - upd}[key]
                )
        return statistics.median(vals)

    print(
        f"\n{'variant':>10} {'s/step':>8} {'gen s':>7} {'update s':>9} {'other s':>8} "
        f"{'vs loop':>8}"
    )
    base = med("loop", "wall") if "loop" in results else None
    for v in results:
        rel = f"{100 * (med(v, 'wall') / base - 1):+7.1f}%" if base else ""
        print(
            f"{v:>10} {med(v, 'wall'):8.2f} {med(v, 'gen'):7.2f} {med(v, 'update'):9.2f} "
            f"{med(v, 'other'):8.3f} {rel:>8}"
        )
    breakdown(results)


def breakdown(results: dict[str, list[dict]]) -> None:
    """Per step, medians: where the step wall goes, and the orchestration share."""
    kinds = ("engine", "storage", "prefect", "tracking")
    print(f"\n{'variant':>10} " + " ".join(f"{k + ' s':>10}" for k in kinds) + "  orchestration")
    for v, runs in results.items():
        rows = []
        for r in runs:
            for s, wall in r["step_s"].items():
                spent = r.get("spent", {}).get(s, {})
                engine, storage = spent.get("engine", 0.0), spent.get("storage", 0.0)
                tracking = spent.get("tracking", 0.0)
                prefect = 0.0 if v == "loop" else wall - engine - storage
                share = (storage + prefect + tracking) / (wall + tracking)
                rows.append((engine, storage, prefect, tracking, share))
        cols = [statistics.median(c) for c in zip(*rows, strict=True)]
        print(f"{v:>10} " + " ".join(f"{c:10.3f}" for c in cols[:4]) + f"  {100 * cols[4]:.1f}%")


if __name__ == "__main__":
    main()
