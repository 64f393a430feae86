"""The same benchmark at two commits, side by side in one invocation: a change's proof that it
costs no speed (a refactor must land within noise).

    .venv/bin/python bench/commits.py OLD_REV [--new REV] [--steps 3] [--rounds 2]

The work is `bench/vs_trl.py`'s hybridrl side: the demo's GRPO step on SmolLM2-135M-Instruct
(8 prompts x 4 samples, 32 new tokens) through `hybridrl train`'s flow, roles in-process,
2 torch threads, one warm-up step and then `--steps` measured steps. OLD_REV (and `--new`, by
default this working tree) is checked out into a temporary git worktree and run by this
Python with that checkout first on the path; the two alternate (A B B A ...). Prints each
run's step seconds, then per commit the median step, steps/hour and the median generation
seconds, and the new/old ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(tree: Path, steps: int) -> list[dict]:
    """One `vs_trl.py --child hybridrl` run in `tree`: its BENCH records (warm-up dropped)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "2",
    }
    cmd = [sys.executable, "bench/vs_trl.py", "--child", "hybridrl", "--steps", str(steps + 1)]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    records = [json.loads(x[6:]) for x in out.stdout.splitlines() if x.startswith("BENCH ")]
    if out.returncode or len(records) != steps + 1:
        sys.exit(f"{tree}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return records[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", help="the commit to compare against")
    ap.add_argument("--new", help="default: this working tree")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridrl-commits-") as tmp:
        trees = {}
        for name, rev in (("old", args.old), ("new", args.new)):
            if rev is None:
                trees[name] = ROOT
                continue
            trees[name] = Path(tmp) / name
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(trees[name]), rev],
                cwd=ROOT,
                check=True,
                capture_output=True,
                timeout=120,
            )
        try:
            steps: dict[str, list[dict]] = {"old": [], "new": []}
            for i in range(args.rounds):
                for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                    got = run(trees[name], args.steps)
                    steps[name] += got
                    shown = [round(r["step_s"], 1) for r in got]
                    print(f"[bench] round {i + 1} {name}: steps {shown} s", flush=True)
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(
                        ["git", "worktree", "remove", "--force", str(tree)],
                        cwd=ROOT,
                        capture_output=True,
                        timeout=120,
                    )
    median = {n: statistics.median(r["step_s"] for r in s) for n, s in steps.items()}
    for name, s in steps.items():
        gen = statistics.median(r.get("gen_s", float("nan")) for r in s)
        print(
            f"{name} ({args.old if name == 'old' else args.new or 'working tree'}): median "
            f"step {median[name]:.2f} s ({3600 / median[name]:.0f} steps/hour), generation "
            f"{gen:.2f} s, {len(s)} steps"
        )
    print(f"new/old steps/hour: {median['old'] / median['new']:.3f}")


if __name__ == "__main__":
    main()
