"""Synchronous vs asynchronous (one-step off-policy) training, side by side in one invocation.

    .venv/bin/python bench/overlap.py [--steps 6] [--rounds 2] [--out bench/results]
    .venv/bin/python bench/overlap.py --learning [--steps 30] [--test-freq 5]

The work: the CPU demo preset (SmolLM2-135M-Instruct, GRPO, 8 prompts x 4 samples, 32 new
tokens), `hybridrl train`'s flow with local storage and no tracking, one warm-up step, then
`--steps` measured steps. The modes, each in its own process, alternately (A B C A B C ...):

    sync-local   trainer.max_staleness=0, the roles in the driver process, 2 torch threads
    sync-pool    trainer.max_staleness=0, trainer.backend=ray: one pool worker, 2 threads
    async        trainer.max_staleness=1: trainer and rollout replica in two pool workers,
                 1 thread each (two 2-thread processes on 2 cores run 6-10x slower)

Per step: the flow's wall seconds (for async: from taking the step's rollout to the end of its
update, so the rollout's time is inside only where the flow waited for it) and the stage
timings. Steps/hour = 3600 / median step wall. "On paper, own devices": the synchronous step
is generation + the rest; with generation on devices of its own, one-step off-policy hides the
shorter of the two: step = max(generation, rest).

`--learning`: sync-local and async for `--steps` steps each, validating every `--test-freq`
steps (greedy accuracy on the demo's held-out questions): accuracy by step and by wall minute.
Writes overlap.json / overlap.md (or overlap-learning.*) to `--out`.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from report import machine  # noqa: E402 - beside this file

MODES = {
    "sync-local": ["trainer.num_threads=2"],
    "sync-pool": ["trainer.num_threads=2", "trainer.backend=ray"],
    "async": ["trainer.num_threads=1", "trainer.max_staleness=1"],
}
COMMON = [
    "tracking.enabled=false",
    "trainer.save_freq=0",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
]


def child(mode: str, steps: int, test_freq: int) -> None:
    """One run of `steps` steps in this process; prints one JSON record per step."""
    from hybrid_engine.roles.workers import reuse_freed_memory

    reuse_freed_memory()
    from flows.train import train
    from hybrid_engine.pool.pool import down

    state = tempfile.mkdtemp(prefix="overlap-ray-")
    os.environ["HYBRIDRL_RAY_STATE"] = state
    with tempfile.TemporaryDirectory(prefix="overlap-") as root:
        overrides = [
            *COMMON,
            *MODES[mode],
            f"trainer.total_training_steps={steps}",
            f"storage.root={root}",
            f"ray.pool_name=overlap-{mode}",
        ]
        if test_freq:
            overrides += [f"trainer.test_freq={test_freq}", "trainer.val_before_train=true"]
        began = time.perf_counter()
        try:
            result = train(
                config=str(ROOT / "configs/demo_cpu.yaml"), overrides=overrides, run_id="b"
            )
            summary = json.loads((Path(root) / "b/final/summary.json").read_text())
        finally:
            if mode != "sync-local":  # the pool and its local head go with the run
                down(f"overlap-{mode}")
    total = time.perf_counter() - began
    for h in summary["history"]:
        step = h["step"]
        record = {"step": step, "wall_s": result["step_wall_s"].get(step), "total_s": total}
        for key in (
            "timing_s/gen",
            "timing_s/update_actor",
            "timing_s/old_log_prob",
            "timing_s/reward",
            "timing_s/adv",
            "timing_s/weight_publish",
            "timing_s/weight_sync",
            "timing_s/val",
            "val/accuracy",
            "critic/score/mean",
            "rollout_corr/rollout_is_mean",
            "rollout_corr/rollout_is_max",
            "rollout_corr/rollout_is_eff_sample_size",
            "rollout_corr/kl",
            "async/staleness/mean",
        ):
            if key in h:
                record[key] = h[key]
        print("BENCH " + json.dumps(record), flush=True)


def run_child(mode: str, steps: int, test_freq: int) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--steps",
            str(steps),
            "--test-freq",
            str(test_freq),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    rows = [json.loads(x[6:]) for x in proc.stdout.splitlines() if x.startswith("BENCH ")]
    if proc.returncode or not rows:
        sys.exit(f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return rows


def med(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else 0.0


def speed(args: argparse.Namespace) -> None:
    runs: dict[str, list[list[dict]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            t0 = time.perf_counter()
            rows = run_child(mode, args.steps + 1, 0)
            runs[mode].append([x for x in rows if x["step"] > 1])  # step 1 warms up
            print(
                f"round {r + 1} {mode}: {time.perf_counter() - t0:.0f} s, median step "
                f"{med(runs[mode][-1], 'wall_s'):.2f} s",
                flush=True,
            )
    out: dict[str, Any] = {"machine": machine(), "steps": args.steps, "rounds": args.rounds}
    for mode, rounds in runs.items():
        rows = [x for rnd in rounds for x in rnd]
        m = {k: med(rows, k) for k in STAGES}
        m["steps_per_hour"] = 3600 / m["wall_s"]
        m["walls"] = [x["wall_s"] for x in rows]
        out[mode] = m
    write(args.out, "overlap", out, speed_lines(out))


STAGES = (
    "wall_s",
    "timing_s/gen",
    "timing_s/update_actor",
    "timing_s/old_log_prob",
    "timing_s/weight_publish",
    "timing_s/weight_sync",
)


def speed_lines(out: dict[str, Any]) -> list[str]:
    """The table and the estimate, from the medians alone (`--render` redraws them)."""
    lines = [
        f"# Synchronous vs one-step off-policy: {out['machine']}",
        "",
        f"Demo preset, {out['steps']} measured steps x {out['rounds']} rounds per mode "
        "(alternating), medians.",
        "",
        "| mode | step wall s | steps/hour | gen s | update s | old log-prob s | "
        "publish s | sync s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in MODES:
        m = out[mode]
        lines.append(
            f"| {mode} | {m['wall_s']:.2f} | {m['steps_per_hour']:.0f} | "
            + " | ".join(f"{m[k]:.2f}" for k in STAGES[1:])
            + " |"
        )
    s, a = out["sync-local"], out["async"]
    gen, rest = s["timing_s/gen"], s["wall_s"] - s["timing_s/gen"]
    # what asynchronous training adds to the trainer's path: the old log-prob pass (the
    # synchronous single update takes them from its own forward) and the publish; measured
    # on 1 thread, an upper bound of their cost on the whole device
    extra = a["timing_s/old_log_prob"] + a["timing_s/weight_publish"]
    low, high = max(gen, rest + extra), max(gen, rest)
    out["own_devices_estimate"] = {
        "sync_s": gen + rest,
        "async_s": [high, low],
        "speedup": [(gen + rest) / low, (gen + rest) / high],
    }
    ratio = a["steps_per_hour"] / s["steps_per_hour"]
    return lines + [
        "",
        f"async vs sync-local: {ratio:.2f}x steps/hour on these 2 shared cores.",
        f"On paper, generation on devices of its own (sync-local's stages: gen {gen:.2f} s, "
        f"rest {rest:.2f} s; async adds old log-probs + publish <= {extra:.2f} s to the "
        f"trainer): step {gen + rest:.2f} -> {high:.2f}..{low:.2f} s, "
        f"{(gen + rest) / low:.2f}x..{(gen + rest) / high:.2f}x.",
    ]


def learning(args: argparse.Namespace) -> None:
    out: dict[str, Any] = {"machine": machine(), "steps": args.steps}
    lines = [
        f"# Learning: synchronous vs one-step off-policy, same seed: {out['machine']}",
        "",
        "| mode | step | wall min | val/accuracy |",
        "| --- | ---: | ---: | ---: |",
    ]
    for mode in ("sync-local", "async"):
        rows = run_child(mode, args.steps, args.test_freq)
        elapsed, points = 0.0, []
        for x in sorted(rows, key=lambda r: r["step"]):
            elapsed += (x.get("wall_s") or 0.0) + x.get("timing_s/val", 0.0)
            if "val/accuracy" in x:
                points.append(
                    {"step": x["step"], "wall_min": elapsed / 60, "accuracy": x["val/accuracy"]}
                )
                lines.append(
                    f"| {mode} | {x['step']} | {elapsed / 60:.1f} | {x['val/accuracy']:.3f} |"
                )
        out[mode] = {"points": points, "total_s": rows[0]["total_s"], "rows": rows}
        print(
            f"{mode}: {rows[0]['total_s']:.0f} s, accuracy {[p['accuracy'] for p in points]}",
            flush=True,
        )
    write(args.out, "overlap-learning", out, lines)


def write(folder: str, name: str, out: dict, lines: list[str]) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    Path(folder, f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    Path(folder, f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--test-freq", type=int, default=5)
    p.add_argument("--learning", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench/results"))
    p.add_argument("--child")
    p.add_argument("--render", action="store_true", help="redraw overlap.md from overlap.json")
    a = p.parse_args()
    if a.render:
        doc = json.loads(Path(a.out, "overlap.json").read_text())
        write(a.out, "overlap", doc, speed_lines(doc))
    elif a.child:
        child(a.child, a.steps, a.test_freq)
    elif a.learning:
        learning(a)
    else:
        speed(a)
