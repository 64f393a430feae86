"""Chaos benchmark: a tiny run with K faults injected at random stages (drawn from a seed),
against the same run without them.

.venv/bin/python bench/chaos.py [--faults 10] [--steps 20] [--seed 0] [--backends ray,local]
                                [--backends async,multiturn]

On the pool (PPO: a 2-rank FSDP actor and a separate critic) the faults are: kill -9 an
actor rank, kill -9 the critic, SIGSTOP a worker, S3 cut for 10 s, SIGTERM to the driver, a
NaN in one step's advantages (actor.skip_nonfinite_steps on). On the local backend (GRPO,
in-process roles): S3 cuts, SIGTERMs and the NaN. `async` (GRPO, trainer.max_staleness=1: a
rollout replica beside the trainer) and `multiturn` (3-turn feedback rollouts on the pool) add a
SIGKILL of the driver (between two turns for multiturn) and kill the rollout replica
mid-generation. Storage is S3 (moto's server behind a TCP
proxy that the benchmark cuts), Prefect a real `prefect server`, MLflow sqlite.

A driver preempted with SIGTERM exits 143 and is restarted with `hybridrl resume`, as the
deployment's "Preempted" trigger does, and so is one SIGKILLed (exit -9), as the trigger on
"Crashed" does; any other failed driver counts as needing a person
(and is resumed too, so the run still ends). The reference run gets the same NaN (a data
fault), so the final weights can be compared bit for bit. Printed: per backend the faults,
how each ended, the final-weights check, the wall-time overhead per fault, and whether
anything was left running.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybrid_engine import STAGES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # servers.py: moto, prefect server, the TCP proxy

BIN = Path(sys.executable).parent
COMMON = [
    "reward.function=reward_fns:length_score",
    "trainer.save_freq=5",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "actor.skip_nonfinite_steps=true",
    "storage.timeout_s=2",
    "storage.retries=1",
    "pipeline.retries=4",
    "pipeline.retry_delay_s=1",
    "pipeline.max_recoveries=10",
    "pipeline.recovery_delay_s=1",
    "pipeline.stage_timeout_s=5",
    "ray.call_timeout_s=300",
]
# backend: (preset, overrides, fault kinds, the pool workers a SIGSTOP may hit)
SETUPS = {
    "ray": (
        "configs/ppo_tiny.yaml",
        ["trainer.backend=ray", "ray.pool_name=chaos", "actor.layout.dp=2", "ray.critic=separate"],
        ["kill_actor", "kill_critic", "stop_worker", "s3_cut", "sigterm", "nan"],
        ["actor-0", "actor-1", "critic-0"],
    ),
    "local": (
        "configs/grpo_tiny.yaml",
        ["rollout.micro_batch_size=8"],
        ["s3_cut", "sigterm", "nan"],
        [],
    ),
    # asynchronous training: the rollout of step N+1 on its own replica beside update N
    "async": (
        "configs/grpo_tiny.yaml",
        ["trainer.max_staleness=1", "ray.pool_name=chaos-async", "ray.call_timeout_s=120"],
        ["kill_actor", "kill_rollout", "stop_worker", "s3_cut", "sigterm", "kill_driver", "nan"],
        ["actor-0", "rollout-0"],
    ),
    # multi-turn rollouts (3 turns of the feedback environment) on the pool
    "multiturn": (
        "configs/multiturn_tiny.yaml",
        ["trainer.backend=ray", "ray.pool_name=chaos-mt"],
        ["kill_actor", "stop_worker", "s3_cut", "sigterm", "kill_driver", "nan"],
        ["actor-0"],
    ),
}
CUT_S = 10.0


def schedule(
    kinds: list[str],
    workers: list[str],
    k: int,
    steps: int,
    rng: random.Random,
    flags: Path,
    turns: bool = False,
) -> list:
    """K faults at distinct steps (2..steps-1): every kind once, the rest drawn (one NaN).
    With `turns` (multi-turn rollouts) a driver SIGKILL lands between two turns."""
    drawn = kinds + [rng.choice([x for x in kinds if x != "nan"]) for _ in range(k - len(kinds))]
    rng.shuffle(drawn)
    faults = []
    for i, (kind, step) in enumerate(
        zip(drawn, sorted(rng.sample(range(2, steps), k)), strict=True)
    ):
        stage = rng.choice(STAGES)
        if kind == "kill_actor":
            rank = rng.randrange(sum(w.startswith("actor-") for w in workers))
            spec = f"step-{step}/{stage}:start=kill-worker:actor-{rank}@0.1"
        elif kind == "kill_rollout":  # inside a generate call: it reports sampled tokens
            spec = f"step-{step}/rollout:start=kill-worker:rollout-0@generating"
        elif kind == "kill_driver":
            spec = f"step-{step}/{'rollout:turn-1' if turns else stage + ':start'}=kill"
        elif kind == "kill_critic":
            spec = f"step-{step}/{stage}:start=kill-worker:critic-0@0.1"
        elif kind == "stop_worker":
            who = rng.choice(workers)
            spec = f"step-{step}/{stage}:start=stop-worker:{who}"
        elif kind == "s3_cut":
            spec = f"step-{step}/{stage}:before_commit=pause:{flags / f'cut-{i}'}"
        elif kind == "sigterm":
            spec = f"step-{step}/{stage}:start=term"
        else:
            spec = f"step-{step}/advantage:batch=nan"
        faults.append({"kind": kind, "step": step, "spec": spec})
    return faults


def drive(
    args: list[str], run_id: str, env: dict, pending: list[str], proxy, log: Path, out_dir: Path
) -> dict:
    """Run the driver until the run finishes: restart after SIGTERM (exit 143) the way the
    deployment trigger does, and after any other failure as a person would."""
    fired_log = log.with_suffix(".fired")  # which faults already happened, per run
    drivers, preempted, crashed, failed, cut_s, errors = 0, 0, 0, 0, 0.0, []
    cmd = ["train", *args, "--run-id", run_id]
    while True:
        drivers += 1
        todo = [p for p in pending if p not in fired(fired_log)]
        run_env = {**env, "HYBRIDRL_FAULT": ";".join(todo), "HYBRIDRL_FAULT_LOG": str(fired_log)}
        with open(log, "a") as f:
            proc = subprocess.Popen(
                [str(BIN / "python"), "-m", "flows.cli", *cmd],
                cwd=ROOT,
                env=run_env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            cut_until = None
            while proc.poll() is None or cut_until is not None:
                for flag in out_dir.glob("cut-*"):  # a driver paused before a commit
                    proxy.cut()
                    cut_until = time.monotonic() + CUT_S
                    flag.unlink()
                if cut_until is not None and time.monotonic() >= cut_until:
                    proxy.restore()
                    cut_s += CUT_S
                    cut_until = None
                time.sleep(0.05)
        if proc.returncode == 0:
            break
        if proc.returncode == 143:
            preempted += 1
        elif proc.returncode == -9:  # SIGKILLed: a deployment's trigger on Crashed restarts it
            crashed += 1
        else:
            failed += 1
            errors.append(last_error(log))
            if failed > 3:
                raise SystemExit(f"{run_id}: the driver failed {failed} times: {errors}")
        cmd = ["resume", run_id, *[a for a in args if a.startswith("storage.")]]
    return {
        "drivers": drivers,
        "preempted": preempted,
        "crashed": crashed,
        "failed": failed,
        "errors": errors,
        "fired": fired(fired_log),
    }


def fired(path: Path) -> list[str]:
    return path.read_text().split("\n")[:-1] if path.exists() else []


def last_error(log: Path) -> str:
    lines = [x for x in log.read_text().splitlines() if x.startswith("error:")]
    return lines[-1] if lines else "(no error line)"


def run_backend(
    backend: str, k: int, steps: int, seed: int, s3: str, proxy, env: dict, out_dir: Path
) -> dict:
    import fsspec
    import torch
    from safetensors.torch import load as st_load

    config, extra, kinds, workers = SETUPS[backend]
    rng = random.Random(f"{seed}-{backend}")
    faults = schedule(kinds, workers, k, steps, rng, out_dir, turns="multiturn" in config)
    bucket = f"chaos-{backend}-{int(time.time())}"
    fs = fsspec.filesystem("s3", endpoint_url=s3)
    fs.mkdir(bucket)
    where = [
        f"storage.root=s3://{bucket}/runs",
        f"storage.endpoint_url=http://127.0.0.1:{proxy.port}",
        f"tracking.uri=sqlite:///{out_dir}/mlflow-{backend}.db",
    ]
    args = [config, f"trainer.total_training_steps={steps}", *COMMON, *extra, *where]
    nan = [f["spec"] for f in faults if f["kind"] == "nan"]

    began = time.perf_counter()
    ref = drive(args, "reference", env, nan, proxy, out_dir / f"{backend}-reference.log", out_dir)
    ref_s = time.perf_counter() - began
    if ref["failed"] or ref["preempted"]:
        raise SystemExit(f"{backend}: the reference run failed: {ref['errors']}")
    down(backend, env, bucket)
    began = time.perf_counter()
    got = drive(
        args,
        "chaos",
        env,
        [f["spec"] for f in faults],
        proxy,
        out_dir / f"{backend}-chaos.log",
        out_dir,
    )
    chaos_s = time.perf_counter() - began
    leftovers = down(backend, env, bucket)

    def weights(run: str) -> dict:
        return st_load(fs.cat_file(f"{bucket}/runs/{run}/final/model.safetensors"))

    a, b = weights("reference"), weights("chaos")
    equal = a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    run = json.loads(fs.cat_file(f"{bucket}/runs/chaos/run.json"))
    summary = json.loads(fs.cat_file(f"{bucket}/runs/chaos/final/summary.json"))
    skipped = sum(r.get("actor/nonfinite_skipped", 0) for r in summary["history"])
    events = run.get("recoveries", [])
    worker = [f for f in faults if f["kind"].startswith(("kill_a", "kill_c", "kill_r", "stop_"))]
    cuts = [f for f in faults if f["kind"] == "s3_cut"]
    terms = [f for f in faults if f["kind"] == "sigterm"]
    kills = [f for f in faults if f["kind"] == "kill_driver"]
    return {
        "backend": backend,
        "faults": faults,
        "fired": len(got["fired"]),
        "worker_faults": len(worker),
        "recoveries": len(events),
        "s3_cuts": len(cuts),
        "nan_skipped_minibatches": skipped,
        "sigterm": len(terms),
        "restarted_after_sigterm": got["preempted"],
        "driver_kills": len(kills),
        "restarted_after_kill": got["crashed"],
        "needing_a_person": got["failed"],
        "errors": got["errors"],
        "weights_equal": equal,
        "reference_s": ref_s,
        "chaos_s": chaos_s,
        "overhead_per_fault_s": (chaos_s - ref_s) / max(1, len(faults)),
        "rebuild_s": [round(e.get("rebuild_s", 0.0), 1) for e in events],
        "drivers": got["drivers"],
        "left_running": leftovers,
    }


def down(backend: str, env: dict, bucket: str) -> list[str]:
    """`pool down`; then whatever this benchmark started that is still running: its local
    Ray head's daemons and their children (the pool workers), its drivers (their command
    line names its bucket; they talk to the benchmark's Prefect server, so they start
    none of their own)."""
    import psutil

    from hybrid_engine.pool.cluster import head_processes

    head = Path(env["HYBRIDRL_RAY_STATE"]) / "head.json"
    temp_dir = json.loads(head.read_text())["temp_dir"] if head.is_file() else None
    pools = [o.split("=", 1)[1] for o in SETUPS[backend][1] if o.startswith("ray.pool_name=")]
    for pool in pools:
        subprocess.run(
            [str(BIN / "hybridrl"), "pool", "down", "--pool", pool],
            env=env,
            capture_output=True,
            timeout=300,
        )
    time.sleep(2)
    left = [f"{p.pid} {p.name()}" for p in head_processes(temp_dir)] if temp_dir else []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if bucket in cmd:
            left.append(f"{p.info['pid']} {cmd[:80]}")
    return left


def table(results: list[dict]) -> str:
    rows = [
        ("faults injected (fired)", lambda r: f"{len(r['faults'])} ({r['fired']})"),
        (
            "  worker kill / SIGSTOP -> pool re-created in the run",
            lambda r: f"{r['worker_faults']} -> {r['recoveries']}",
        ),
        (
            "  S3 cut 10 s -> ridden out by retries",
            lambda r: f"{r['s3_cuts']} -> {r['s3_cuts'] if not r['needing_a_person'] else '?'}",
        ),
        (
            "  NaN advantages -> mini-batches skipped",
            lambda r: f"1 -> {r['nan_skipped_minibatches']:.0f}",
        ),
        (
            "  SIGTERM -> exit 143, restarted by resume",
            lambda r: f"{r['sigterm']} -> {r['restarted_after_sigterm']}",
        ),
        (
            "  driver SIGKILL -> restarted by resume",
            lambda r: f"{r['driver_kills']} -> {r['restarted_after_kill']}",
        ),
        ("needing a person", lambda r: str(r["needing_a_person"])),
        (
            "final weights equal to the reference run",
            lambda r: "yes" if r["weights_equal"] else "NO",
        ),
        (
            "wall: reference / with faults",
            lambda r: f"{r['reference_s']:.0f} s / {r['chaos_s']:.0f} s",
        ),
        ("overhead per fault", lambda r: f"{r['overhead_per_fault_s']:.1f} s"),
        ("pool re-creations (s each)", lambda r: ", ".join(map(str, r["rebuild_s"])) or "-"),
        ("driver processes started", lambda r: str(r["drivers"])),
        (
            "left running afterwards",
            lambda r: "nothing" if not r["left_running"] else "; ".join(r["left_running"]),
        ),
    ]
    head = "| | " + " | ".join(r["backend"] for r in results) + " |"
    lines = [head, "| --- |" + " --- |" * len(results)]
    lines += [f"| {name} | " + " | ".join(fn(r) for r in results) + " |" for name, fn in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", default="ray,local")
    ap.add_argument("--out", default=None, help="where logs go (default: a temp dir)")
    a = ap.parse_args()
    from servers import TcpProxy, start_moto, start_prefect, stop

    out = Path(a.out or tempfile.mkdtemp(prefix="hybridrl-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    moto, s3 = start_moto()
    prefect, api = start_prefect(out / "prefect-home")
    proxy = TcpProxy(int(s3.rsplit(":", 1)[1]))
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "PYTHONPATH": str(ROOT / "tests"),
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "HYBRIDRL_RAY_STATE": str(out / "ray"),
    }
    os.environ.update(
        {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    )
    results = []
    try:
        for backend in a.backends.split(","):
            print(
                f"[chaos] {backend}: {a.faults} faults over {a.steps} steps (logs in {out})",
                flush=True,
            )
            r = run_backend(backend, a.faults, a.steps, a.seed, s3, proxy, env, out)
            for f in r["faults"]:
                print(f"  {f['kind']:<12} {f['spec']}")
            results.append(r)
    finally:
        proxy.cut()
        stop(prefect)
        stop(moto)
    (out / "chaos.json").write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
