"""How a GRPO step's time grows with the work: samples per step and response length.

    .venv/bin/python bench/scaling.py [--steps 2] [--threads 2] [--out bench/results]

The demo's model and task (SmolLM2-135M fp32, basic_arithmetic), the engine in this process
(the stages `hybridrl train` runs, without Prefect and storage: bench/overhead.py measures
those), 4 samples per prompt. Two sweeps from the 32 samples x 32 tokens of bench/vs_trl.py:
samples per step 8 -> 64 at 32 tokens, and response length 16 -> 128 at 32 samples.

Every response runs to the full length (EOS is not honoured here, so that "response length"
is the work done, not a cap the model stops short of). Each point: one warm-up step, then the
median of `--steps` steps. Writes `scaling.json`, `scaling.md` and `scaling.png` to `--out`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from report import write_report  # noqa: E402 - beside this file

SAMPLES_PER_PROMPT = 4
SAMPLES = [8, 16, 32, 64]  # at 32 tokens
LENGTHS = [16, 32, 64, 128]  # at 32 samples


def measure(samples: int, length: int, steps: int, threads: int) -> dict[str, Any]:
    from hybrid_engine.config import load_config
    from hybrid_engine.engine import Engine

    cfg = load_config(
        ROOT / "configs/demo_cpu.yaml",
        [
            f"data.train_batch_size={samples // SAMPLES_PER_PROMPT}",
            f"rollout.n={SAMPLES_PER_PROMPT}",
            f"rollout.max_new_tokens={length}",
            f"rollout.micro_batch_size={samples}",
            f"actor.ppo_mini_batch_size={samples}",
            "reward.overlong_buffer_len=0",
            "trainer.val_before_train=false",
            f"trainer.num_threads={threads}",
        ],
    )
    engine = Engine(cfg)
    engine.actor.rollout.eos_token_id = -1  # no token is -1: every response has `length` tokens
    records = []
    for step in range(1, steps + 2):
        m = engine.step(step)
        records.append(
            {
                "step_s": m["timing_s/step"],
                "gen_s": m["timing_s/gen"],
                "update_s": m["timing_s/update_actor"],
                "response_tokens": m["response_length/mean"] * samples,
                "prompt_tokens": m["prompt_length/mean"] * samples,
            }
        )
    measured = records[1:]  # after the warm-up step
    point = {k: statistics.median(r[k] for r in measured) for k in measured[0]}
    point |= {"samples": samples, "length": length, "steps": len(measured)}
    point["other_s"] = point["step_s"] - point["gen_s"] - point["update_s"]
    print(
        f"[scaling] {samples:3d} samples x {length:3d} tokens: step {point['step_s']:6.1f} s "
        f"(generation {point['gen_s']:5.1f}, update {point['update_s']:5.1f})",
        flush=True,
    )
    return point


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="measured steps per point")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    args = ap.parse_args()
    started = time.perf_counter()
    points = {(s, 32): measure(s, 32, args.steps, args.threads) for s in SAMPLES}
    for n in LENGTHS:
        if (32, n) not in points:
            points[32, n] = measure(32, n, args.steps, args.threads)
    report = {
        "samples": [points[s, 32] for s in SAMPLES],
        "length": [points[32, n] for n in LENGTHS],
        "seconds": time.perf_counter() - started,
    }
    write_report(args.out, "scaling", report, table, plot)


def table(r: dict[str, Any]) -> str:
    """Each sweep with the step time relative to its first point and to linear growth."""
    parts = []
    for sweep, key, label in (
        ("samples", "samples", "samples per step (32 tokens each)"),
        ("length", "length", "response tokens (32 samples)"),
    ):
        pts = r[sweep]
        base = pts[0]
        lines = [
            f"| {label} | step (s) | generation (s) | update (s) | other (s) | "
            f"step / first | work / first | generation s per 1k tokens | "
            f"update s per 1k tokens |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for p in pts:
            tokens = p["response_tokens"] / 1000
            work = (p["prompt_tokens"] + p["response_tokens"]) / (
                base["prompt_tokens"] + base["response_tokens"]
            )
            lines.append(
                f"| {p[key]} | {p['step_s']:.1f} | {p['gen_s']:.1f} | {p['update_s']:.1f} | "
                f"{p['other_s']:.2f} | {p['step_s'] / base['step_s']:.2f}x | {work:.2f}x | "
                f"{p['gen_s'] / tokens:.2f} | {p['update_s'] / tokens:.2f} |"
            )
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, sweep, key, xlabel in (
        (axes[0], "samples", "samples", "samples per step (32 tokens)"),
        (axes[1], "length", "length", "response tokens (32 samples)"),
    ):
        pts = r[sweep]
        xs = [p[key] for p in pts]
        ax.plot(xs, [p["step_s"] for p in pts], "o-", label="step", color="black")
        ax.plot(xs, [p["gen_s"] for p in pts], "s-", label="generation", color="#4c78a8")
        ax.plot(xs, [p["update_s"] for p in pts], "^-", label="update", color="#f58518")
        ax.plot(
            xs,
            [pts[0]["step_s"] * x / xs[0] for x in xs],
            ":",
            color="grey",
            label="step, if linear from the first point",
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("seconds (median)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("GRPO step on 2 CPU cores, SmolLM2-135M fp32, as the work grows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
