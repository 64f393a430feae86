"""Several runs on one pool against the same runs one after another, with a remote judge.

    .venv/bin/python bench/sharing.py [--runs 3] [--steps 4] [--latencies 0,2,4,6]
                                      [--preset configs/demo_cpu.yaml] [--out bench/results]

The work: `--runs` runs of the preset that differ in `trainer.seed` (1, 2, 3, ...), each
`--steps` steps of `hybridrl train` on the Ray pool (one worker holding the policy and
reference), scored by `bench/judge.py`, an HTTP judge on 127.0.0.1 that answers each batch
after a set latency (the preset's own scorer behind it). Per latency, two modes:

    sequential  the runs one after another, each alone on a pool of its own
                (`ray.when_busy=refuse`), the pool taken down after it
    shared      the runs started at the same moment on one pool (`ray.when_busy=share`):
                they take turns at the worker stage by stage, and while one waits for the
                judge, another's stage runs

One Prefect API and one judge serve every run; the benchmark keeps a Ray head of its own.
Reported per mode: the wall time from the first start to the last end, aggregate steps per
hour, each run's wall, and from the runs' step metrics the seconds waiting for a turn
(`timing_s/pool_wait`) and swapping a run's slot in (`timing_s/pool_switch`). Each shared
run's final weights are compared with its sequential run's, bit for bit.
Writes sharing.json / sharing.md to `--out`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "tests"))  # servers.py: the Prefect API
from report import machine, write_report  # noqa: E402 - beside this file

COMMON = [
    "trainer.backend=ray",
    "trainer.num_threads=2",
    "tracking.enabled=false",
    "trainer.save_freq=0",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "reward.function=judge:score",
]


def start_judge(latency: float, preset: str) -> tuple[subprocess.Popen, str]:
    """bench/judge.py in its own process: (process, its URL)."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "judge.py"), "--latency", str(latency)]
        + ["--preset", preset],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        raise RuntimeError(f"the judge did not start: {line!r}")
    return proc, line.split()[-1]


def launch(run: str, seed: int, root: Path, args, pool: str, mode: str, env) -> subprocess.Popen:
    busy = "share" if mode == "shared" else "refuse"
    cmd = [str(BIN / "hybridrl"), "train", args.preset, *COMMON]
    cmd += [f"trainer.total_training_steps={args.steps}", f"trainer.seed={seed}"]
    cmd += [f"ray.pool_name={pool}", f"ray.when_busy={busy}", f"ray.max_runs={args.runs}"]
    cmd += ["--storage-root", str(root), "--run-id", run]
    log = (root / f"{run}.log").open("w")
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def finished(proc: subprocess.Popen, run: str, root: Path, started: float) -> dict[str, Any]:
    """Wait for one run; its wall, its step metrics' pool seconds and its final weights."""
    import json

    from safetensors.torch import load_file

    rc = proc.wait()
    wall = time.perf_counter() - started
    if rc != 0:
        tail = (root / f"{run}.log").read_text()[-3000:]
        raise RuntimeError(f"run {run} exited with {rc}:\n{tail}")
    history = json.loads((root / run / "final" / "summary.json").read_text())["history"]
    steps = [h for h in history if "timing_s/step" in h] or history
    total = lambda key: sum(h.get(key, 0.0) for h in steps)  # noqa: E731
    return {
        "run": run,
        "wall_s": wall,
        "end_s": time.perf_counter(),
        "step_s_median": statistics.median(h["timing_s/step"] for h in steps)
        if "timing_s/step" in steps[0]
        else None,
        "pool_wait_s": total("timing_s/pool_wait"),
        "pool_switch_s": total("timing_s/pool_switch"),
        "reward_s": total("timing_s/reward"),
        "weights": load_file(str(root / run / "final" / "model.safetensors")),
    }


def pool_down(pool: str, env) -> None:
    subprocess.run(
        [str(BIN / "hybridrl"), "pool", "down", "--pool", pool],
        env=env,
        cwd=ROOT,
        capture_output=True,
        check=False,
    )


def one_mode(mode: str, latency: float, args, env, work: Path) -> dict[str, Any]:
    root = work / f"{mode}-{latency:g}"
    root.mkdir(parents=True)
    runs = [(f"{mode}-{latency:g}-seed{s}", s) for s in range(1, args.runs + 1)]
    start = time.perf_counter()
    results = []
    if mode == "sequential":
        for run, seed in runs:
            pool = f"bench-solo-{seed}"
            t0 = time.perf_counter()
            results.append(finished(launch(run, seed, root, args, pool, mode, env), run, root, t0))
            pool_down(pool, env)
    else:
        procs = [
            (launch(run, seed, root, args, "bench-shared", mode, env), run) for run, seed in runs
        ]
        results = [finished(p, run, root, start) for p, run in procs]
        pool_down("bench-shared", env)
    wall = max(r["end_s"] for r in results) - start
    print(f"latency {latency:g} s, {mode}: {wall:.0f} s", flush=True)
    return {"wall_s": wall, "steps_per_hour": args.runs * args.steps * 3600 / wall, "runs": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--latencies", default="0,2,4,6", help="judge seconds per batch")
    ap.add_argument("--preset", default="configs/demo_cpu.yaml")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    from servers import start_prefect, stop

    work = Path(tempfile.mkdtemp(prefix="hrl-bench-sharing-"))
    prefect, api = start_prefect(work / "prefect-home")
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "PYTHONPATH": str(ROOT / "bench"),  # judge:score
        "HYBRIDRL_RAY_STATE": str(work / "ray"),  # a head of its own, never the user's
    }
    rows = []
    try:
        for latency in [float(x) for x in args.latencies.split(",")]:
            judge, url = start_judge(latency, args.preset)
            env["HYBRIDRL_JUDGE_URL"] = url
            try:
                seq = one_mode("sequential", latency, args, env, work)
                shared = one_mode("shared", latency, args, env, work)
            finally:
                stop(judge)
            rows.append(row(latency, seq, shared))
    finally:
        subprocess.run([str(BIN / "hybridrl"), "cluster", "down"], env=env, check=False)
        stop(prefect)
    report = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "bench/sharing.py " + " ".join(sys.argv[1:]),
        "runs": args.runs,
        "steps": args.steps,
        "preset": args.preset,
        "rows": rows,
    }
    write_report(args.out, "sharing", report, table)


def row(latency: float, seq: dict, shared: dict) -> dict[str, Any]:
    import torch

    equal = [
        all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
        for a, b in zip(seq["runs"], shared["runs"], strict=True)
    ]
    plain = lambda m: [  # noqa: E731
        {k: v for k, v in r.items() if k not in ("weights", "end_s")} for r in m["runs"]
    ]
    return {
        "latency_s": latency,
        "sequential": {**seq, "runs": plain(seq)},
        "shared": {**shared, "runs": plain(shared)},
        "speedup": seq["wall_s"] / shared["wall_s"],
        "weights_equal": equal,
    }


def table(report: dict[str, Any]) -> str:
    steps = report["runs"] * report["steps"]
    lines = [
        f"{report['runs']} runs x {report['steps']} steps of {report['preset']} ({steps} steps "
        f"in all), {report['machine']}, {report['date']}: `{report['command']}`",
        "",
        "| judge latency | sequential | shared | speedup | steps/hour seq / shared "
        "| run walls, shared | wait / switch per step, shared | weights = alone |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        seq, sh = r["sequential"], r["shared"]
        walls = ", ".join(f"{x['wall_s']:.0f}" for x in sh["runs"])
        wait = sum(x["pool_wait_s"] for x in sh["runs"]) / steps
        switch = sum(x["pool_switch_s"] for x in sh["runs"]) / steps
        lines.append(
            f"| {r['latency_s']:g} s | {seq['wall_s']:.0f} s | {sh['wall_s']:.0f} s "
            f"| {r['speedup']:.2f}x | {seq['steps_per_hour']:.0f} / {sh['steps_per_hour']:.0f} "
            f"| {walls} s | {wait:.2f} / {switch:.3f} s "
            f"| {sum(r['weights_equal'])} of {len(r['weights_equal'])} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
