"""Soak: memory, object store, open files and storage over a long run of the real pipeline.

    python bench/soak.py                        # the tiny preset, 500 steps on the pool
    python bench/soak.py --preset demo          # the CPU demo, 100 steps in-process
    python bench/soak.py --steps 60 [overrides...]

`hybridrl train` runs as a child process: the Prefect flow, stage storage, checkpoints
(every `--save-freq` steps, `trainer.max_ckpt_to_keep=2`) and MLflow on sqlite, all in a temp
dir; on the pool, a Ray head of the benchmark's own. Each time a step's update commits, this
process samples, without joining the cluster:

- RSS and open file descriptors of every process: the driver, its children (Prefect's
  temporary API server), the pool's workers (`ray::` processes), Ray's daemons (GCS, raylet, agents);
- the object store: the bytes of the primary copies the raylet pins, and its plasma objects;
- the bytes under the run's storage directory, and the checkpoints kept.

It prints each figure at the first sampled step, at step 50 (after warm-up) and at the end,
with the growth from step 50, and writes every sample to bench/results/soak-<preset>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# A head of the benchmark's own: stopping it never touches the user's pools.
os.environ.setdefault("HYBRIDRL_RAY_STATE", os.path.join(tempfile.gettempdir(), "hrl-bench-soak"))
os.environ.setdefault("RAY_debug_dump_period_milliseconds", "1000")  # the object store's stats

import psutil  # noqa: E402

from hybrid_engine.pool.cluster import head_processes, state_dir, stop_local_head  # noqa: E402

ROOT = Path(__file__).parents[1]
PRESETS = {
    "tiny": ("configs/grpo_tiny.yaml", 500, ["trainer.backend=ray", "ray.pool_name=soak"]),
    "demo": ("configs/demo_cpu.yaml", 100, ["trainer.backend=local"]),
}
WARM = 50  # the step after which every figure should stay flat


def processes(driver: psutil.Process) -> dict[str, list[psutil.Process]]:
    """The processes of the run, by kind."""
    kinds: dict[str, list[psutil.Process]] = {
        "driver": [driver],
        "children": [],
        "workers": [],
        "ray": [],
    }
    with contextlib.suppress(psutil.Error):  # Prefect's temporary API server
        kinds["children"] = driver.children(recursive=True)
    head = state_dir() / "head.json"
    if head.is_file():
        for p in head_processes(json.loads(head.read_text())["temp_dir"]):
            try:
                kind = (
                    "workers" if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::") else "ray"
                )
            except psutil.Error:
                continue
            kinds[kind].append(p)
    return kinds


def object_store() -> tuple[float, int] | tuple[None, None]:
    """(MB, objects) in the object store: the primary copies the raylet pins and its count of
    plasma objects, from the debug state it writes every RAY_debug_dump_period_milliseconds
    (set to 1 s here; Ray's `ray memory` would need grpcio, which Ray does not install)."""
    head = state_dir() / "head.json"
    if not head.is_file():
        return None, None
    logs = Path(json.loads(head.read_text())["temp_dir"]) / "session_latest" / "logs"
    try:
        text = (logs / "debug_state.txt").read_text()
    except OSError:
        return None, None
    pinned = re.search(r"- pinned objects size: (\d+)", text)
    objects = re.search(r"- num local plasma objects: (\d+)", text)
    if not (pinned and objects):
        return None, None
    return int(pinned.group(1)) / 2**20, int(objects.group(1))


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def sample(step: int, driver: psutil.Process, run_dir: Path) -> dict:
    row: dict = {"step": step, "t": time.time()}
    for kind, procs in processes(driver).items():
        rss, fds, n = 0, 0, 0
        for p in procs:
            try:
                rss += p.memory_info().rss
                fds += p.num_fds()
                n += 1
            except psutil.Error:
                continue
        row |= {f"{kind}_rss_mb": rss / 2**20, f"{kind}_fds": fds, f"{kind}_procs": n}
    row["object_store_mb"], row["object_store_objects"] = object_store()
    row["storage_mb"] = tree_bytes(run_dir) / 2**20
    row["steps_mb"] = tree_bytes(run_dir / "steps") / 2**20
    row["checkpoints"] = sorted(
        int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*")
    )
    return row


def committed(run_dir: Path) -> int:
    """The last step whose update stage is committed."""
    steps = [int(p.name) for p in (run_dir / "steps").glob("*") if p.name.isdigit()]
    done = [s for s in steps if (run_dir / "steps" / str(s) / "update" / "COMMITTED").exists()]
    return max(done, default=0)


def report(rows: list[dict], preset: str) -> str:
    at = {r["step"]: r for r in rows}
    first, end = rows[0], rows[-1]
    warm = at.get(WARM) or min(rows, key=lambda r: abs(r["step"] - WARM))
    keys = [
        k
        for k in first
        if k.endswith(("_mb", "_fds", "_procs", "_objects")) and first[k] is not None
    ]
    lines = [
        f"soak, preset {preset}: steps {first['step']}..{end['step']}, "
        f"{(end['t'] - first['t']) / 60:.1f} min",
        f"{'figure':22} {'step ' + str(first['step']):>12} {'step ' + str(warm['step']):>12} "
        f"{'step ' + str(end['step']):>12} {'growth':>9}",
    ]
    for k in keys:
        growth = (end[k] - warm[k]) / warm[k] * 100 if warm[k] else 0.0
        lines.append(f"{k:22} {first[k]:12.1f} {warm[k]:12.1f} {end[k]:12.1f} {growth:8.1f}%")

    def near(step: int) -> dict:
        return min(rows, key=lambda r: abs(r["step"] - step))

    for lo, hi in ((warm["step"], warm["step"] + 50), (end["step"] - 50, end["step"])):
        a, b = near(lo), near(hi)
        lo, hi = a["step"], b["step"]
        if hi > lo:
            per = (b["steps_mb"] - a["steps_mb"]) / (hi - lo)
            lines.append(f"steps/ per step, steps {lo}..{hi}: {per * 1024:.1f} KB")
    lines.append(f"checkpoints at the last sample: {end['checkpoints']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--steps", type=int, help="default: 500 (tiny), 100 (demo)")
    parser.add_argument("--save-freq", type=int, default=25)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config, steps, preset_overrides = PRESETS[args.preset]
    steps = args.steps or steps
    work = Path(tempfile.mkdtemp(prefix=f"hrl-soak-{args.preset}-"))
    run_dir = work / "runs" / "soak"
    cmd = [
        str(Path(sys.executable).parent / "hybridrl"),
        "train",
        config,
        *preset_overrides,
        f"trainer.total_training_steps={steps}",
        f"trainer.save_freq={args.save_freq}",
        "trainer.max_ckpt_to_keep=2",
        f"storage.root={work / 'runs'}",
        f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
        *args.overrides,
        "--run-id",
        "soak",
    ]
    print("[soak]", " ".join(cmd), flush=True)
    log = open(work / "driver.log", "w")  # noqa: SIM115 - open for the child's lifetime
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    driver = psutil.Process(child.pid)
    rows: list[dict] = []
    seen = 0
    try:
        while child.poll() is None:
            done = committed(run_dir) if run_dir.exists() else 0
            if done > seen:
                seen = done
                rows.append(sample(done, driver, run_dir))
                r = rows[-1]
                if done == 1 or done % 10 == 0:
                    print(
                        f"[soak] step {done}/{steps}: driver {r['driver_rss_mb']:.0f}+"
                        f"{r['children_rss_mb']:.0f} MB, "
                        f"workers {r['workers_rss_mb']:.0f} MB, object store "
                        f"{r['object_store_mb'] or 0:.1f} MB, fds {r['driver_fds']}+"
                        f"{r['workers_fds']}+{r['ray_fds']}, storage {r['storage_mb']:.1f} MB",
                        flush=True,
                    )
            time.sleep(0.2)
    except KeyboardInterrupt:  # Ctrl-C: stop the run, report the samples so far
        print(f"[soak] interrupted at step {seen}", flush=True)
    finally:
        if child.poll() is None:
            child.terminate()
            child.wait(60)
        log.close()
    if child.returncode != 0 and len(rows) < 2:
        sys.exit(f"[soak] the run failed ({child.returncode}): see {work / 'driver.log'}")
    kept = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*"))
    ended = "after the run" if child.returncode == 0 else f"stopped ({child.returncode})"
    text = report(rows, args.preset) + (
        f"\n{ended}: checkpoints {kept} (trainer.max_ckpt_to_keep=2), storage "
        f"{tree_bytes(run_dir) / 2**20:.1f} MB"
    )
    print(text)
    out = ROOT / "bench" / "results" / f"soak-{args.preset}.json"
    cpu_info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in cpu_info if "model name" in ln), platform.processor()
    )
    meta = {"cmd": cmd, "cpu": cpu, "cores": os.cpu_count(), "report": text.splitlines()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"[soak] samples in {out}; run in {work}")
    if args.preset == "tiny":
        stop_local_head()


if __name__ == "__main__":
    main()
