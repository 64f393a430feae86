"""The learning table: each recipe's preset trained on the demo task, held-out greedy accuracy
at steps 0, 20, 40, 60 and the wall time, one recipe after the other (never two at once).

.venv/bin/python bench/recipes.py [--recipes grpo,dr_grpo,...] [--steps 60] [--seed 1]
    [--out bench/results/recipes.json] [overrides...]

A recipe is a preset: `grpo` is configs/demo_cpu.yaml, any other name configs/<name>_cpu.yaml.
The plain in-process loop runs it (no Prefect, no storage: the figures are the training's).
Each recipe runs in a process of its own (its peak RSS is its own). Results are appended to
the JSON file as each recipe finishes, so a stopped run keeps them; a recipe already in the
file (same seed, steps and overrides) is skipped. Prints a markdown table.
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

from report import cpu_model  # beside this file

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.loop import train
from hybrid_engine.step_metrics import peak_rss_gb

ALL = ["grpo", "dr_grpo", "gspo", "cispo", "sapo", "dapo", "lora"]


def preset(recipe: str) -> str:
    return "configs/demo_cpu.yaml" if recipe == "grpo" else f"configs/{recipe}_cpu.yaml"


def run(recipe: str, steps: int, seed: int, every: int, overrides: list[str]) -> dict:
    cfg = load_config(
        preset(recipe),
        [
            f"trainer.total_training_steps={steps}",
            f"trainer.test_freq={every}",
            f"trainer.seed={seed}",
            "trainer.val_before_train=true",
            *overrides,
        ],
    )
    start = time.perf_counter()

    def show(step: int, m: dict) -> None:
        acc = f" val {m['val/accuracy']:.3f}" if "val/accuracy" in m else ""
        took = f" {m['timing_s/step']:.1f}s" if "timing_s/step" in m else ""
        print(f"  [{recipe}] step {step}{took}{acc}", flush=True)

    engine, history = train(cfg, on_step=show, engine=Engine(cfg))
    minutes = (time.perf_counter() - start) / 60
    rows = {h["step"]: h for h in history}
    step_s = [h["timing_s/step"] for h in history if "timing_s/step" in h]
    entropy = {s: rows[s].get("actor/entropy") for s in rows if s and s % every == 0}
    multi_turn = {  # multi-turn presets: held-out turns, and the training rollouts' per step
        key: {s: rows[s][key] for s in rows if key in rows[s]}
        for key in (
            "val/turns/mean",
            "val/success_rate",
            "multi_turn/turns/mean",
            "multi_turn/success_rate",
            "multi_turn/tool_call_rate",
        )
        if any(key in r for r in rows.values())
    }
    return {
        "recipe": recipe,
        "preset": preset(recipe),
        "seed": seed,
        "steps": steps,
        "accuracy": {s: rows[s]["val/accuracy"] for s in rows if "val/accuracy" in rows[s]},
        "entropy": entropy,
        **({"multi_turn": multi_turn} if multi_turn else {}),
        "wall_min": minutes,
        "median_step_s": statistics.median(step_s),
        "gen_batches_per_step": statistics.mean(
            h.get("dynamic_sampling/gen_batches", 1.0) for h in history if h["step"]
        ),
        "rounds_per_step": statistics.mean(
            h.get("dynamic_sampling/rounds", 1.0) for h in history if h["step"]
        ),
        "prompts_per_step": statistics.mean(
            h.get("dynamic_sampling/prompts_consumed", cfg.data.train_batch_size)
            for h in history
            if h["step"]
        ),
        "gen_s_per_step": statistics.mean(h["timing_s/gen"] for h in history if h["step"]),
        "peak_rss_gb": peak_rss_gb(),
        "val_questions": len(engine.data.val),
        "overrides": overrides,
    }


def table(results: list[dict], steps: int, every: int) -> str:
    marks = list(range(0, steps + 1, every))
    head = [
        "recipe",
        *[f"step {s}" for s in marks],
        "wall min",
        "median step s",
        "entropy at the end",
        "generation batches / step",
        "rounds / step",
        "prompts / step",
        "generation s / step",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        acc = [
            f"{100 * r['accuracy'][str(s)]:.1f}%" if str(s) in r["accuracy"] else "—" for s in marks
        ]
        ent = r["entropy"].get(str(steps))
        lines.append(
            "| "
            + " | ".join(
                [
                    r["recipe"],
                    *acc,
                    f"{r['wall_min']:.1f}",
                    f"{r['median_step_s']:.1f}",
                    "—" if ent is None else f"{ent:.3f}",
                    f"{r['gen_batches_per_step']:.2f}",
                    f"{r.get('rounds_per_step', r['gen_batches_per_step']):.2f}",
                    f"{r.get('prompts_per_step', 0):.1f}",
                    f"{r.get('gen_s_per_step', 0):.1f}",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default=",".join(ALL))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench/results/recipes.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one recipe, JSON to --out
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out)
    if args.one:
        result = run(args.one, args.steps, args.seed, args.every, args.overrides)
        out.write_text(json.dumps(result))
        return
    doc = json.loads(out.read_text()) if out.is_file() else {"cpu": cpu_model(), "results": []}
    for recipe in args.recipes.split(","):
        if any(
            r["recipe"] == recipe
            and r["seed"] == args.seed
            and r["steps"] == args.steps
            and r["overrides"] == args.overrides
            for r in doc["results"]
        ):
            print(f"{recipe}: in {out} already")
            continue
        print(f"{recipe}: {preset(recipe)}, {args.steps} steps, seed {args.seed}", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [
                sys.executable,
                __file__,
                "--one",
                recipe,
                "--steps",
                str(args.steps),
                "--every",
                str(args.every),
                "--seed",
                str(args.seed),
                "--out",
                tmp.name,
                *args.overrides,
            ]
            if subprocess.run(cmd).returncode != 0:
                print(f"{recipe}: failed (see above)", flush=True)
                continue
            result = json.loads(Path(tmp.name).read_text())
        doc["results"].append(result)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
    done = [r for r in doc["results"] if r["steps"] == args.steps]
    print(f"\n{doc['cpu']}, {len(done)} runs\n")
    print(table(done, args.steps, args.every))


if __name__ == "__main__":
    main()
