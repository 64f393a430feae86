"""Training with the `vllm` rollout beside the `hf` one: the same preset, seed and steps,
each backend in a process of its own, one after the other (never both at once).

    .venv/bin/python bench/vllm_training.py [--preset configs/demo_cpu.yaml] [--steps 10]
        [--out bench/results] [override ...]

Per backend: the engine's start-up, held-out greedy accuracy before and after, and the
median over the steps after the first (the first holds vLLM's warm-up round) of the step,
its generation, rollout tokens/s, the weight push into the engine, and the actor update
(the vLLM process stays alive through it: an update no slower than `hf`'s says it does not
take the trainer's cores while it waits). Writes `vllm_training.{json,md}` under `--out`.
Needs the vLLM environment (`bash scripts/setup_vllm.sh`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import machine, write_report  # beside this file

BACKENDS = ("hf", "vllm")
KEYS = {  # column -> step metric
    "step s": "timing_s/step",
    "generation s": "timing_s/gen",
    "rollout tok/s": "perf/tokens_per_s_rollout",
    "weight push s": "timing_s/weight_sync",
    "update s": "timing_s/update_actor",
    "response length": "response_length/mean",  # the update's cost grows with it
    "log-prob gap max": "rollout/logprob_gap_max",
}


def run(preset: str, backend: str, steps: int, overrides: list[str]) -> dict:
    """One backend's run in this process: the plain loop, validating before and after."""
    from hybrid_engine.config import load_config
    from hybrid_engine.engine import Engine
    from hybrid_engine.loop import train

    cfg = load_config(
        preset,
        [
            f"rollout.name={backend}",
            f"trainer.total_training_steps={steps}",
            f"trainer.test_freq={steps}",
            "trainer.val_before_train=true",
            *overrides,
        ],
    )
    start = time.perf_counter()
    engine = Engine(cfg)
    built_s = time.perf_counter() - start

    def show(step: int, m: dict) -> None:
        took = f" {m['timing_s/step']:.1f}s" if "timing_s/step" in m else ""
        acc = f" val {m['val/accuracy']:.3f}" if "val/accuracy" in m else ""
        print(f"  [{backend}] step {step}{took}{acc}", flush=True)

    try:
        _, history = train(cfg, on_step=show, engine=engine)
    finally:
        if backend == "vllm":
            engine.actor.rollout.close()
    later = [h for h in history if h["step"] >= 2]  # step 1: vLLM's warm-up round
    medians = {
        col: statistics.median(h[key] for h in later if key in h)
        for col, key in KEYS.items()
        if any(key in h for h in later)
    }
    rows = {h["step"]: h for h in history}
    return {
        "backend": backend,
        "engine_built_s": built_s,
        "first_step_s": rows[1]["timing_s/step"],
        "accuracy_before": rows[0]["val/accuracy"],
        "accuracy_after": rows[steps]["val/accuracy"],
        "medians": medians,
        "wall_min": (time.perf_counter() - start) / 60,
    }


def table(report: dict) -> str:
    cols = ["engine built s", "first step s", *KEYS, "held-out before", "held-out after"]
    lines = [
        f"{report['machine']}; {report['preset']}, {report['steps']} steps, "
        f"medians over steps 2-{report['steps']}; {report['date']}",
        "",
        "| backend | " + " | ".join(cols) + " |",
        "| --- |" + " --- |" * len(cols),
    ]
    for r in report["runs"]:
        m = r["medians"]
        cells = [
            f"{r['engine_built_s']:.1f}",
            f"{r['first_step_s']:.1f}",
            *(
                "—"
                if col not in m
                else f"{m[col]:.1e}"
                if col == "log-prob gap max"
                else f"{m[col]:.2f}"
                for col in KEYS
            ),
            f"{100 * r['accuracy_before']:.1f}%",
            f"{100 * r['accuracy_after']:.1f}%",
        ]
        lines.append(f"| {r['backend']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="configs/demo_cpu.yaml")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--one", choices=BACKENDS, help=argparse.SUPPRESS)  # internal
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps: at least 2 (the first step holds vLLM's warm-up)")
    if args.one:
        result = run(args.preset, args.one, args.steps, args.overrides)
        Path(args.json).write_text(json.dumps(result))
        return
    runs = []
    for backend in BACKENDS:
        print(f"{backend}: {args.preset}, {args.steps} steps", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, __file__, "--one", backend, "--json", tmp.name]
            cmd += ["--preset", args.preset, "--steps", str(args.steps), *args.overrides]
            if subprocess.run(cmd).returncode != 0:
                sys.exit(f"{backend}: failed (see above)")
            runs.append(json.loads(Path(tmp.name).read_text()))
    report = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "steps": args.steps,
        "overrides": args.overrides,
        "runs": runs,
    }
    write_report(args.out, "vllm_training", report, table)


if __name__ == "__main__":
    main()
