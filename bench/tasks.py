"""Which reasoning-gym tasks can the demo's model learn? The base policy on each candidate
before any training: greedy accuracy, pass@k, and mixed@k (questions where some but not all
of k samples are right: the prompt groups GRPO learns from; all right or all wrong gives
every sample advantage 0).

    .venv/bin/python bench/tasks.py [--tasks leg_counting,...] [--questions 64] [--k 4]
        [--out bench/results/tasks.json]

Each candidate is the demo preset (configs/demo_cpu.yaml: its model, system prompt, sampling
and lengths) with the task and its level swapped in; `hybrid_engine.evaluation.evaluate_policy`
scores it on `--questions` held-out rows (greedy, then k samples at the preset's temperature,
a fixed seed). One candidate after the other in this process; results are appended to
`--out` as each finishes and a candidate already there (same questions and k) is skipped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from report import cpu_model  # noqa: E402 - beside this file

from hybrid_engine.config import load_config  # noqa: E402
from hybrid_engine.engine import Engine  # noqa: E402
from hybrid_engine.evaluation import evaluate_policy  # noqa: E402

# name: (reasoning-gym task, its level), each of another shape than the demo's two-term sums
CANDIDATES = {
    "chain_sum_3x1": ("chain_sum", {"min_terms": 3, "max_terms": 3, "max_digits": 1}),
    "arithmetic_3x1": (
        "basic_arithmetic",
        {
            "min_terms": 3,
            "max_terms": 3,
            "min_digits": 1,
            "max_digits": 1,
            "operators": ["+", "-"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
    ),
    "legs_1-2": ("leg_counting", {"min_animals": 1, "max_animals": 2, "max_instances": 3}),
    "letters_3-5": ("letter_counting", {"min_words": 3, "max_words": 5}),
    "products_1x1": ("products", {"max_digits": 1}),
}


def probe(name: str, questions: int, k: int) -> dict:
    task, level = CANDIDATES[name]
    cfg = load_config(
        ROOT / "configs/demo_cpu.yaml",
        [
            f"data.train_source=reasoning_gym:{task}",
            f"data.task_config={json.dumps(level)}",
            f"data.val_size={questions}",
            f"data.train_size={questions}",
        ],
    )
    start = time.perf_counter()
    got = evaluate_policy(Engine(cfg), k)
    return {
        "candidate": name,
        "task": task,
        "level": level,
        "k": k,
        "questions": int(got["eval/questions"]),
        "greedy": got["eval/accuracy"],
        "pass_at_k": got[f"eval/pass_at_{k}"],
        "mixed_at_k": got[f"eval/mixed_at_{k}"],
        "format": got["eval/format_rate"],
        "length": got["eval/response_length/mean"],
        "seconds": time.perf_counter() - start,
        "machine": cpu_model(),
        "date": datetime.date.today().isoformat(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default=",".join(CANDIDATES))
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench/results/tasks.json"))
    args = ap.parse_args()
    out = Path(args.out)
    results = json.loads(out.read_text())["results"] if out.exists() else []
    for name in args.tasks.split(","):
        if name not in CANDIDATES:
            raise SystemExit(
                f"--tasks: unknown candidate {name!r} (known: {', '.join(CANDIDATES)})"
            )
        done = [
            r
            for r in results
            if (r["candidate"], r["questions"], r["k"]) == (name, args.questions, args.k)
        ]
        if not done:
            print(f"{name}: {args.questions} questions, k={args.k}", flush=True)
            results.append(probe(name, args.questions, args.k))
            out.write_text(json.dumps({"results": results}, indent=1) + "\n")
    print("| candidate | task | greedy | pass@k | mixed@k | format | length | k | questions |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['candidate']} | {r['task']} | {r['greedy']:.1%} | {r['pass_at_k']:.1%} | "
            f"{r['mixed_at_k']:.1%} | {r['format']:.1%} | {r['length']:.1f} | {r['k']} | "
            f"{r['questions']} |"
        )


if __name__ == "__main__":
    main()
