"""Dynamic sampling's rollout cost: rounds sized by the kept rate vs one batch per round.

    .venv/bin/python bench/dynamic_sampling.py [--steps 4] [--repeats 2]
        [--out bench/results/dynamic_sampling.json] [overrides...]

1. What a round costs by its size: `HFRollout.generate` on 1 to 32 prompts x 4 samples (the
   decode batch holds them all), 32 new tokens, seconds per call.
2. The rollout stage of `configs/dapo_cpu.yaml` (default overrides: a harder task, 3 terms of
   1-3 digits, on which few groups vary) at the base weights, `--steps` steps of
   `Engine.sample` without updates, with `adaptive_rounds` true and false. Each setting runs
   in a process of its own (its peak RSS is its own), the two alternating `--repeats` times.
   Per step: rounds, prompts used, generation seconds. No training, so both settings see the
   same weights; the prompts differ once their rounds differ.
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

import hybrid_engine  # noqa: F401  (before ray)

HARDER = [
    "data.task_config.min_terms=3",
    "data.task_config.max_terms=3",
    "data.task_config.max_digits=3",
]


def round_cost(prompts: list[int]) -> list[dict]:
    """Seconds of one generate call per round size (prompts x 4 samples, one decode batch)."""
    from hybrid_engine.config import load_config
    from hybrid_engine.data import PromptData, prompt_batch
    from hybrid_engine.models.loading import load_policy, load_tokenizer
    from hybrid_engine.rollout.base import SamplingParams
    from hybrid_engine.rollout.hf import HFRollout

    cfg = load_config("configs/demo_cpu.yaml")
    tok = load_tokenizer(cfg.model)
    model = load_policy(cfg.model, tok, seed=0).eval()
    data = PromptData(cfg.data)
    rows = [r for g in range(1, 1 + max(prompts) // 8 + 1) for r in data.step_rows(g)]
    out = []
    for p in prompts:
        batch = prompt_batch(rows[:p], tok, 256).repeat_interleave(4)
        rollout = HFRollout(model, tok.pad_token_id, tok.eos_token_id, micro_batch_size=len(batch))
        start = time.perf_counter()
        got = rollout.generate(batch, SamplingParams(32, 1.0, seed=p))
        seconds = time.perf_counter() - start
        out.append(
            {"prompts": p, "rows": len(batch), "seconds": seconds, "tokens": got.meta["gen_tokens"]}
        )
        print(f"  {p:3d} prompts ({len(batch):3d} rows): {seconds:.2f} s", flush=True)
    return out


def sample_steps(adaptive: bool, steps: int, overrides: list[str]) -> dict:
    """`steps` rollout stages of the DAPO preset at the base weights."""
    from hybrid_engine.config import load_config
    from hybrid_engine.engine import Engine
    from hybrid_engine.step_metrics import peak_rss_gb

    cfg = load_config(
        "configs/dapo_cpu.yaml",
        [*overrides, f"algorithm.filter_groups.adaptive_rounds={str(adaptive).lower()}"],
    )
    engine = Engine(cfg)
    per_step = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        m = engine.sample(step).meta["metrics"]
        per_step.append(
            {
                "rounds": m["dynamic_sampling/rounds"],
                "gen_batches": m["dynamic_sampling/gen_batches"],
                "prompts": m["dynamic_sampling/prompts_consumed"],
                "kept_groups": m["dynamic_sampling/kept_groups"],
                "gen_s": m["timing_s/gen"],
                "stage_s": time.perf_counter() - start,
            }
        )
        print(f"  adaptive={adaptive} step {step}: {per_step[-1]}", flush=True)
    return {"adaptive": adaptive, "steps": per_step, "peak_rss_gb": peak_rss_gb()}


def summary(runs: list[dict]) -> str:
    lines = [
        "| adaptive_rounds | rounds / step | prompts / step | generation s / step | peak RSS GB |",
        "| --- | --- | --- | --- | --- |",
    ]
    for adaptive in (False, True):
        mine = [r for r in runs if r["adaptive"] == adaptive]
        steps = [s for r in mine for s in r["steps"]]

        def mean(k: str, steps: list = steps) -> float:
            return statistics.mean(s[k] for s in steps)

        rss = max(r["peak_rss_gb"] for r in mine)
        lines.append(
            f"| {str(adaptive).lower()} | {mean('rounds'):.2f} | {mean('prompts'):.1f} | "
            f"{mean('gen_s'):.1f} | {rss:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench/results/dynamic_sampling.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: "true"/"false", JSON to --out
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    overrides = args.overrides or HARDER
    if args.one:
        got = sample_steps(args.one == "true", args.steps, overrides)
        Path(args.out).write_text(json.dumps(got))
        return
    print("round cost, one generate call per size:", flush=True)
    cost = round_cost([1, 2, 4, 8, 16, 32])
    runs = []
    for r in range(args.repeats):
        for adaptive in (False, True) if r % 2 == 0 else (True, False):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--one", str(adaptive).lower()]
                cmd += ["--steps", str(args.steps), "--out", f.name, *overrides]
                subprocess.run(cmd, check=True)
                runs.append(json.loads(Path(f.name).read_text()))
    table = summary(runs)
    print(table)
    Path(args.out).write_text(
        json.dumps(
            {"overrides": overrides, "round_cost": cost, "runs": runs, "table": table}, indent=1
        )
    )


if __name__ == "__main__":
    main()
